import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_boost import cli
from lightning_boost.doctor import (
    CHECKS,
    check_cpus,
    check_devices,
    check_distributed,
    check_gpu,
    check_open_files,
    check_shm,
    run_checks,
)
from lightning_boost.hardware import EXAMPLES, MIB, HardwareInfo
from lightning_boost.report import Finding, Severity

CPU = EXAMPLES["cpu"]
# A CUDA build on a GPU machine whose driver is too old for it: torch sees no device.
BROKEN_CUDA = CPU.replace(
    cpu_only_build=False,
    cuda_version="13.0",
    nvidia_driver_present=True,
    cuda_error="The NVIDIA driver on your system is too old (found version 11040).",
)


def only(findings: list[Finding]) -> Finding:
    assert len(findings) == 1, findings
    return findings[0]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_healthy_examples_have_no_fail(name: str) -> None:
    report = run_checks(EXAMPLES[name])
    assert report.worst is not Severity.ERROR
    assert {f.source for f in report.findings} == {"doctor"}


def test_cpu_build_with_visible_gpu_fails_with_install_hint() -> None:
    finding = only(check_gpu(CPU.replace(nvidia_driver_present=True)))
    assert finding.severity is Severity.ERROR
    assert "CPU-only build" in finding.title
    assert "pip install --force-reinstall torch" in finding.fix


def test_unusable_cuda_fails_with_the_reason() -> None:
    finding = only(check_gpu(BROKEN_CUDA))
    assert finding.severity is Severity.ERROR
    assert "driver on your system is too old" in finding.detail
    assert "nvidia-smi" in finding.fix and "CUDA_VISIBLE_DEVICES" in finding.fix


def test_a_cpu_run_on_a_gpu_machine_warns_that_the_gpu_stays_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulated: the H100 machine (its HardwareInfo), a Trainer pinned to the CPU. There the report
    # said "An NVIDIA GPU is visible but CUDA is unusable" (an ERROR) of a working GPU.
    from lightning_boost._lightning import hardware_for
    from lightning_boost.testing import tiny_trainer

    monkeypatch.setattr(HardwareInfo, "detect", classmethod(lambda cls: EXAMPLES["h100"]))
    hardware = hardware_for(tiny_trainer(tmp_path))
    assert hardware.accelerator == "cpu" and hardware.device_count == 0 and hardware.unused_gpus == 1
    finding = only(check_gpu(hardware))
    assert finding.severity is Severity.WARN and "this run trains on the CPU" in finding.title
    assert "accelerator='cpu'" in finding.fix


def test_cpu_box_without_driver_is_ok() -> None:
    finding = only(check_gpu(CPU))
    assert finding.severity is Severity.INFO and "runs on the CPU" in finding.title


@pytest.mark.parametrize(
    ("name", "precision", "tf32"),
    [
        ("t4", "16-mixed", False),
        ("v100", "16-mixed", False),
        ("a100x8", "bf16-mixed", True),
        ("h100", "bf16-mixed", True),
    ],
)
def test_devices_and_precision(name: str, precision: str, tf32: bool) -> None:
    hw = EXAMPLES[name]
    findings = check_devices(hw)
    devices = [f for f in findings if f.title.startswith("cuda:")]
    assert len(devices) == hw.device_count
    assert f"compute capability {hw.min_compute_capability[0]}." in devices[0].detail
    choice = findings[-1]
    assert choice.data == {"precision": precision, "tf32": tf32}
    assert choice.fix == f"Trainer(precision={precision!r})"


def test_cpu_precision_is_full() -> None:
    assert only(check_devices(CPU)).data["precision"] == "32-true"


def test_a_bf16_cpu_is_not_promised_bf16_before_the_model_is_timed() -> None:
    finding = only(check_devices(EXAMPLES["cpu-bf16"]))
    assert finding.data["precision"] == "bf16-mixed"
    assert "faster than fp32" in finding.title and "timed on your model" in finding.title


@pytest.mark.parametrize(
    ("shm", "severity"),
    [
        (64 * MIB, Severity.WARN),
        (512 * MIB, Severity.WARN),
        (1024 * MIB, Severity.INFO),
        (None, Severity.INFO),
    ],
)
def test_shm(shm: int | None, severity: Severity) -> None:
    finding = only(check_shm(EXAMPLES["t4"].replace(shm_bytes=shm)))
    assert finding.severity is severity
    if severity is Severity.WARN:
        assert "--shm-size" in finding.fix and "--ipc=host" in finding.fix
        assert "MiB" in finding.title


@pytest.mark.parametrize(
    ("soft", "hard", "severity", "fix"),
    [
        (1024, 1048576, Severity.WARN, "`ulimit -n 1048576`"),
        (1024, 1024, Severity.WARN, "raise the hard limit"),
        (1024, None, Severity.WARN, "`ulimit -n 65536`"),
        (4096, 4096, Severity.INFO, ""),
        (None, None, Severity.INFO, ""),
    ],
)
def test_open_files(soft: int | None, hard: int | None, severity: Severity, fix: str) -> None:
    finding = only(check_open_files(CPU.replace(open_files_limit=soft, open_files_hard_limit=hard)))
    assert finding.severity is severity
    assert fix in finding.fix
    if severity is Severity.WARN:
        assert "set_sharing_strategy('file_system')" in finding.fix


@pytest.mark.parametrize(
    ("name", "changes", "per_process", "workers", "severity"),
    [
        ("cpu", {}, 8, 7, Severity.INFO),
        ("a100x8", {}, 12, 11, Severity.INFO),
        ("a100x8", {"cpus_available": 8}, 1, 0, Severity.WARN),
        ("cpu", {"cpus_available": 1}, 1, 0, Severity.INFO),  # no GPU to starve
        ("h100x8-2nodes", {}, 24, 23, Severity.INFO),
    ],
)
def test_cpus_per_process(
    name: str, changes: dict[str, int], per_process: int, workers: int, severity: Severity
) -> None:
    finding = only(check_cpus(EXAMPLES[name].replace(**changes)))
    assert finding.data == {"cpus_per_process": per_process, "max_workers": workers}
    assert finding.severity is severity


def test_nccl_checked_only_for_multi_gpu() -> None:
    assert check_distributed(EXAMPLES["h100"]) == []
    assert check_distributed(CPU.replace(local_world_size=2)) == []
    ok = only(check_distributed(EXAMPLES["a100x8"]))
    assert ok.severity is Severity.INFO and "NCCL 2." in ok.title
    fail = only(check_distributed(EXAMPLES["a100x8"].replace(nccl_available=False, nccl_version=None)))
    assert fail.severity is Severity.ERROR and "8 process(es) per node x 1 node(s)" in fail.detail


def test_every_check_runs_on_every_example() -> None:
    for hw in EXAMPLES.values():
        for check in CHECKS:
            assert all(isinstance(f, Finding) for f in check(hw))


def test_cli_json_parses_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert status == (1 if any(f["severity"] == "error" for f in data["findings"]) else 0)
    assert data["schema_version"] == 1
    assert data["hardware"]["cpus_available"] >= 1
    assert {f["area"] for f in data["findings"]} >= {"environment", "data"}
    import platform

    import lightning

    assert data["versions"]["python"] == platform.python_version()
    assert data["versions"]["lightning"] == lightning.__version__ and data["versions"]["os"]


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_boost import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"lightning-boost {__version__}"


def test_the_package_and_its_command_start_without_torch() -> None:
    # `lightning-boost --help` took 5.7 s importing torch and Lightning it did not need.
    code = (
        "import sys, lightning_boost, lightning_boost.cli;"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'imported eagerly';"
        "from lightning_boost import SyncGuard, __all__;"
        "import lightning_boost as lb;"
        "assert all(getattr(lb, name) is not None for name in __all__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr


def test_cli_exits_1_on_fail(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Simulated: this machine has no NVIDIA driver, so the broken-CUDA machine is made up.
    monkeypatch.setattr(HardwareInfo, "detect", classmethod(lambda cls: BROKEN_CUDA))
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line, so the text can be matched
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "CUDA is unusable" in out and "1 FAIL" in out


def test_python_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_boost", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    assert json.loads(result.stdout)["hardware"]["torch_version"]


def test_the_demo_says_how_to_get_torchvision(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed: only the demo needs it
    assert cli.main(["demo"]) == 2
    assert "pip install 'lightning-boost[demo]'" in capsys.readouterr().out
