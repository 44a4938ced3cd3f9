from __future__ import annotations

import pytest
import torch

from services.common.platforms import PlatformError, current_platform, detect_platform


def test_cpu_machine_detects_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = detect_platform()
    assert p.device_type == "cpu"
    assert p.queue == "cpu"
    assert p.device() == torch.device("cpu")
    assert p.max_memory_allocated() is None


def test_cuda_detected_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    p = detect_platform()
    assert (p.device_type, p.vendor, p.queue) == ("cuda", "nvidia", "gpu")


def test_rocm_build_is_cuda_with_rocm_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert detect_platform("auto").vendor == "rocm"


def test_xpu_detected_when_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if not hasattr(torch, "xpu"):
        pytest.skip("this torch build has no torch.xpu module")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    assert detect_platform("auto").device_type == "xpu"


def test_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect_platform("cpu").device_type == "cpu"
    assert current_platform("cpu").device_type == "cpu"
    # a caller without settings in hand gets TANDEM_DEVICE through CommonSettings
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")
    current_platform.cache_clear()
    try:
        assert current_platform().device_type == "cpu"
    finally:
        current_platform.cache_clear()


def test_override_to_missing_device_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlatformError, match="cuda"):
        detect_platform("cuda")
    with pytest.raises(PlatformError, match="npu"):
        detect_platform("npu")  # torch_npu is not installed here
    with pytest.raises(PlatformError, match="tpu"):
        detect_platform("tpu")


def test_a_onednn_isa_cap_below_amx_keeps_amx_out_of_the_choices() -> None:
    from services.common.platforms import onednn_may_use_amx

    assert onednn_may_use_amx({})
    assert onednn_may_use_amx({"ONEDNN_MAX_CPU_ISA": "all"})
    assert onednn_may_use_amx({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})
    assert not onednn_may_use_amx({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert not onednn_may_use_amx({"DNNL_MAX_CPU_ISA": "AVX2"})
    # the newer name wins over the older one
    assert onednn_may_use_amx({"ONEDNN_MAX_CPU_ISA": "DEFAULT", "DNNL_MAX_CPU_ISA": "AVX2"})
