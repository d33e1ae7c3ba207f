"""refusion: decode, train and compare diffusion language models (ReFusion and its rivals)."""

__version__ = "0.1.0"
