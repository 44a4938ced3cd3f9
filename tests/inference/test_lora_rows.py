"""``lora_rows``: each row through its own adapter, as PEFT's mixed batch computes it, bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model

from services.inference.engine.lora_rows import LoraRows, routable, routed_forward

BASE = "__base__"


def _two_adapter_layer() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40))
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    )
    model.add_adapter("b", LoraConfig(r=8, lora_alpha=4, target_modules=["0"], init_lora_weights=False))
    model.eval()
    layer = model.base_model.model[0]
    with torch.no_grad():
        for p in layer.lora_B.parameters():
            p.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize(
    "names",
    [
        ["default", BASE, "b", "default", "b", BASE, BASE],  # two adapters beside base rows
        ["b"] * 5,  # one adapter on every row
        [BASE, BASE, "default"],
    ],
)
@pytest.mark.parametrize("shape", [(), (1,)])  # decode rows [T, in], prompt tokens [T, 1, in]
def test_routed_rows_get_peft_mixed_batch_numbers_bit_for_bit(
    names: list[str], shape: tuple[int, ...]
) -> None:
    layer = _two_adapter_layer()
    assert routable(layer)
    x = torch.randn(len(names), *shape, 48)
    with torch.inference_mode():
        expected = layer(x, adapter_names=names)
        for whole in (False, True):
            rows = LoraRows.of(names, BASE, x.device, whole=whole)
            assert rows is not None
            got = routed_forward(layer, rows, x)
            assert torch.equal(got, expected), (names, whole)
        # through the module call, as the runner swaps it in (the hook's adapter_names dropped)
        rows = LoraRows.of(names, BASE, x.device, whole=False)
        assert rows is not None
        vars(layer)["forward"] = functools.partial(routed_forward, layer, rows)
        try:
            assert torch.equal(layer(x, adapter_names=names), expected)
        finally:
            del vars(layer)["forward"]
    # the adapters did change their rows (the comparison is not of base products)
    assert not torch.equal(expected, layer.base_layer(x))


def test_no_adapter_rows_route_nothing() -> None:
    assert LoraRows.of([BASE, BASE], BASE, torch.device("cpu"), whole=True) is None
    rows = LoraRows.of(["a", BASE, "a"], BASE, torch.device("cpu"), whole=True)
    assert rows is not None and rows.rows["a"] is not None and rows.rows["a"].tolist() == [0, 2]
    whole = LoraRows.of(["a", "a"], BASE, torch.device("cpu"), whole=True)
    assert whole is not None and whole.rows == {"a": None}
