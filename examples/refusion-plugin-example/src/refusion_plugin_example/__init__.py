"""An example refusion plugin package (see docs/plugins.md)."""
