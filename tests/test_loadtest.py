"""scripts/loadtest_serve.py on the tiny model and synthetic reviews, with a few requests: its correctness
checks and JSON (never its speed)."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_loadtest_checks_every_request_and_reports_each_level(trained_dir, synthetic_data_dir, tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(REPO / "scripts" / "loadtest_serve.py"), "-c", str(trained_dir),
           "--data", str(synthetic_data_dir), "--texts", "40", "--requests", "30", "--concurrency", "1,4",
           "--texts-per-request", "2", "--latency-requests", "5", "--malformed", "27", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    assert all(lv["requests"] == 30 and lv["reviews"] == 60 and lv["good_failed"] == 0 for lv in result["levels"])
    assert all(lv["server_cpu_ms_per_review"] > 0 and lv["client_cpu_ms_per_review"] > 0 for lv in result["levels"])
    mixed = result["mixed"]
    assert mixed["malformed"] == 27 and mixed["malformed_without_4xx"] == 0 and mixed["good_failed"] == 0
    assert set(mixed["malformed_statuses"]) == {400, 413, 422}
    assert result["correct"] and result["server_exit_code"] == 0
    assert "correctness: ok" in done.stdout
