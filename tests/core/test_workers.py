"""One-thread worker processes: every job runs once, one thread each, failures are return codes."""

import sys

from refusion.core.workers import Job, run_jobs


def test_jobs_run_once_each_with_one_thread_and_failures_are_reported(tmp_path):
    code = "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])"
    jobs = [Job(f"ok{i}", [sys.executable, "-c", code], tmp_path / f"ok{i}" / "log") for i in range(2)]
    jobs.append(Job("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "bad.log"))
    seen = []
    done = run_jobs(jobs, workers=2, on_finish=seen.append)
    assert sorted(f.name for f in done) == ["bad", "ok0", "ok1"] and seen == done
    assert {f.name: f.returncode for f in done} == {"ok0": 0, "ok1": 0, "bad": 3}
    assert all(f.wall_s > 0 for f in done)
    assert (tmp_path / "ok0" / "log").read_text().split() == ["1", "1"]
    assert (tmp_path / "bad.log").read_text().strip() == "boom"
