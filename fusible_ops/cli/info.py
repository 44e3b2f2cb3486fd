"""``python -m fusible_ops info``: versions, devices and every backend's availability."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from ..kernels import backend_names, backend_report, get_backend


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def devices() -> list[tuple[torch.device, str]]:
    found = [(torch.device("cpu"), f"{_cpu_name()}, {torch.backends.cpu.get_cpu_capability()}")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            found.append((torch.device("cuda", i), f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})"))
    return found


def main(args=None) -> int:
    import fusible_ops

    print(
        f"fusible-ops {fusible_ops.__version__}, python {platform.python_version()}, torch {torch.__version__}"
    )
    for dist in ("triton", "nvidia-cudnn-frontend", "transformer-engine"):
        print(f"  {dist}: {_version(dist)}")
    print(f"  CUDA available: {torch.cuda.is_available()}; CPU threads: {torch.get_num_threads()}")
    print("devices:")
    for device, name in devices():
        print(f"  {device}: {name}")
    print("backends (select with fusible_ops.settings(backend=NAME); 'auto' picks per device and dtype):")
    for name in backend_names():
        try:
            description = get_backend(name).description
        except ImportError as error:
            description = f"(module failed to import: {error})"
        print(f"  {name}: {description}")
        for device, _ in devices():
            by_status: dict[str, list[str]] = {}
            for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
                reason = dict(backend_report(device, dtype))[name]
                status = "available" if reason is None else f"unavailable: {reason}"
                by_status.setdefault(status, []).append(str(dtype).replace("torch.", ""))
            for status, dtypes in by_status.items():
                print(f"    {device} {'/'.join(dtypes)}: {status}")
    return 0
