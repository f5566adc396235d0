"""The threads and loader workers each rank gets (layers/machine.py) and how the CLI applies them."""
import os

import pytest
import torch

from layers import machine
from layers.machine import apply_cpu_plan, loader_workers, plan_cpu


def plan(cores, node=None, ranks=1, accelerator="cpu", workers="auto", **environ):
    return plan_cpu(affinity=cores, node_cpus=node or cores, ranks_on_node=ranks, accelerator=accelerator,
                    num_workers=workers, environ=environ)


def test_two_cores_training_on_the_cpu_load_in_the_main_process_with_every_core_computing():
    chosen = plan(2)
    assert (chosen.cores, chosen.threads, chosen.workers) == (2, 2, 0)


def test_one_gpu_on_sixteen_cores_loads_in_fifteen_workers_beside_one_main_thread():
    chosen = plan(16, accelerator="gpu")
    assert (chosen.cores, chosen.threads, chosen.workers) == (16, 1, 15)


def test_eight_gpus_on_sixty_four_cores_share_the_node_eight_cores_each():
    chosen = plan(64, ranks=8, accelerator="gpu")
    assert (chosen.cores, chosen.threads, chosen.workers) == (8, 1, 7)


def test_a_rank_bound_to_its_own_cores_is_not_divided_again():
    # SLURM's --cpus-per-task=8 gives each of the node's 8 ranks an affinity of 8 of its 64 cores
    chosen = plan(8, node=64, ranks=8, accelerator="gpu")
    assert (chosen.cores, chosen.workers) == (8, 7)


def test_a_many_core_node_with_one_gpu_does_not_fork_a_worker_per_core():
    assert plan(128, accelerator="gpu").workers == machine.MAX_GPU_WORKERS


def test_a_larger_cpu_gives_a_share_of_its_cores_to_loading():
    chosen = plan(16)
    assert 1 <= chosen.workers <= 4 and chosen.threads == 16 - chosen.workers


def test_explicit_workers_and_threads_win():
    chosen = plan(16, accelerator="gpu", workers=4)
    assert (chosen.workers, chosen.workers_from, chosen.threads) == (4, "num_workers", 12)
    chosen = plan(2, OMP_NUM_THREADS="1")
    assert (chosen.threads, chosen.threads_from) == (1, "OMP_NUM_THREADS")
    chosen = plan(64, ranks=8, accelerator="gpu", SUITE_THREADS="3", OMP_NUM_THREADS="1")
    assert (chosen.threads, chosen.threads_from) == (3, "SUITE_THREADS")


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_thread_setting_is_named(bad):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{bad}'"):
        plan(2, OMP_NUM_THREADS=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "many", True])
def test_a_bad_worker_count_is_named(bad):
    with pytest.raises(ValueError, match="num_workers must be 'auto' or a count"):
        plan(2, workers=bad)


def test_the_start_up_line_says_what_was_chosen_and_why():
    assert plan(2).describe() == "CPU per rank: 2 cores, 2 torch threads, loading in the main process (auto)"
    line = plan(64, ranks=8, accelerator="gpu", OMP_NUM_THREADS="2").describe()
    assert line == "CPU per rank: 8 cores (8 ranks on this node), 2 torch threads (OMP_NUM_THREADS), 7 loader workers (auto)"


def test_applying_a_plan_sets_torch_and_the_environment_of_later_ranks(monkeypatch):
    monkeypatch.setattr(machine, "_applied", None)
    forget_exported_threads(monkeypatch)
    before = torch.get_num_threads()
    try:
        applied = apply_cpu_plan(plan(16, accelerator="gpu", workers=2))
        assert torch.get_num_threads() == applied.threads == 14
        assert os.environ["OMP_NUM_THREADS"] == "14"
        # a rank started later inherits the count, and plans it again rather than taking it for the user's
        assert plan(16, accelerator="gpu", **os.environ).threads_from == "auto"
        assert loader_workers("auto") == 2 and loader_workers(5) == 5
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("task", ["classify", "detect", "segment", "translate"])
def test_each_task_cli_applies_the_plan_to_its_loaders_and_says_so(task, tmp_path, monkeypatch, caplog):
    """The real CLI of each task on a 16-core CPU (the machine faked): the training loader starts the
    plan's workers and torch runs the plan's threads; an explicit --data.num_workers wins."""
    from tasks.cli import suite as cli_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(machine, "_applied", None)
    forget_exported_threads(monkeypatch)
    monkeypatch.setattr(cli_module, "machine_cores", lambda: (16, 16))
    quiet = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu"]
    before = torch.get_num_threads()
    caplog.set_level("INFO")
    try:
        for flags, workers in (([], 4), (["--data.num_workers", "1"], 1)):
            machine._applied = None
            cli = main_without_running(task, [*quiet, *flags], monkeypatch)
            assert machine._applied.workers == workers and torch.get_num_threads() == 16 - workers
            cli.datamodule.setup("fit")
            assert cli.datamodule.train_dataloader().num_workers == workers
            assert f"CPU per rank: 16 cores, {16 - workers} torch threads, {workers} loader worker" in caplog.text
    finally:
        torch.set_num_threads(before)


def main_without_running(task, args, monkeypatch):
    """The SuiteCLI that ``python -m tasks.<task> ARGS`` builds, instantiated but not run."""
    from configs.tasks import task_declaration
    from tasks.cli.suite import main

    # without a subcommand nothing inserts the task's demo recipe: name it
    return main(task, ["--config", str(task_declaration(task).demo_recipe_path), *args], run=False)


def forget_exported_threads(monkeypatch):
    """No thread setting in the environment; the test leaves it as it found it."""
    for name in ("OMP_NUM_THREADS", machine.PLANNED, "SUITE_THREADS"):
        monkeypatch.setenv(name, "1")  # recorded, so that it is restored
        monkeypatch.delenv(name)


@pytest.mark.parametrize("cores, others, threads", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.7, 1), (2, 1.9, 1),
                                                     (16, 3.2, 13), (16, 40.0, 1)])
def test_threads_give_way_to_the_cores_other_processes_keep_busy(cores, others, threads):
    assert machine.threads_beside(plan(cores, workers=0), others) == threads


def test_other_load_counts_another_process_and_not_this_one():
    import subprocess
    import sys
    import time

    load = machine.OtherLoad()
    if not load.available:
        pytest.skip("no /proc/stat")
    time.sleep(1.0)
    if load.sample() > 0.3:  # the assertions below read other processes' load: they need a quiet machine
        pytest.skip("other processes keep this machine busy")
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # this process's own work is not another's
        pass
    assert load.sample() < 0.5
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    load.sample()
    spinner.wait()
    assert load.sample() > 0.5


def test_threads_follow_load_only_where_it_may(monkeypatch):
    from tasks.cli.runtime import ThreadsFollowLoad

    def started(chosen, deterministic=False):
        monkeypatch.setattr(machine, "_applied", chosen)
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
        callback = ThreadsFollowLoad()
        callback.on_train_start(None, None)
        return callback.load is not None

    assert started(plan(2)) == machine.OtherLoad().available
    assert not started(plan(2), deterministic=True)  # a changed thread count may reorder a float reduction
    assert not started(plan(16))  # loader workers' CPU time would look like another process's
    assert not started(plan(16, accelerator="gpu", workers=0))
    assert not started(plan(2, OMP_NUM_THREADS="2"))  # the user's count stays


def test_a_container_cpu_quota_caps_the_cores_the_plan_counts(tmp_path):
    """Docker's --cpus / a Kubernetes limit leave the affinity at every core of the node and set a CFS quota:
    cgroup v2's cpu.max "250000 100000" is 2.5 cores -> 3; v1's quota/period the same; no quota -> affinity."""
    from layers.machine import cgroup_cpu_limit, machine_cores

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == 3
    assert machine_cores(str(v2))[0] == min(3, len(os.sched_getaffinity(0)))
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(tmp_path / "v1")) == 1 and machine_cores(str(tmp_path / "v1"))[0] == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(str(tmp_path / "v1")) is None
    assert cgroup_cpu_limit(str(tmp_path / "nowhere")) is None
    assert machine_cores(str(tmp_path / "nowhere"))[0] == len(os.sched_getaffinity(0))
