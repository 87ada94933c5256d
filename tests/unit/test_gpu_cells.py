"""tests/gpu's cells spread over a machine's GPUs (gpu/runs.py's cell_env), checked without a GPU."""

from __future__ import annotations

from gpu import runs

TRAIN = ["python", "train.py", "--device=cuda"]
TORCHRUN = ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py"]


def environment(monkeypatch, worker: str, gpus: int, command: list[str]) -> dict:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runs, "gpu_count", lambda: gpus)
    return runs.cell_env(command)


def test_one_process_cells_run_on_their_workers_gpu(monkeypatch):
    seen = [environment(monkeypatch, f"gw{i}", 4, TRAIN)["CUDA_VISIBLE_DEVICES"] for i in range(6)]
    assert seen == ["0", "1", "2", "3", "0", "1"]


def test_torchrun_cells_and_one_gpu_machines_see_every_gpu(monkeypatch):
    assert "CUDA_VISIBLE_DEVICES" not in environment(monkeypatch, "gw1", 4, TORCHRUN)
    assert "CUDA_VISIBLE_DEVICES" not in environment(monkeypatch, "gw1", 1, TRAIN)
    assert "CUDA_VISIBLE_DEVICES" not in environment(monkeypatch, "master", 4, TRAIN)


def test_a_choice_of_gpus_made_outside_is_kept(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setattr(runs, "gpu_count", lambda: 4)
    assert runs.cell_env(TRAIN)["CUDA_VISIBLE_DEVICES"] == "2"
