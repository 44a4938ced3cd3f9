"""``lora_rows``: each row through its own adapter, as PEFT's mixed batch computes it (within
rounding), and a row's numbers the same bit for bit alone as beside other rows."""

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
        ["default", BASE, "b", "default", "b", BASE, BASE, "b", "b", "default"],  # two adapters, base rows
        ["b"] * 5,  # one adapter on every row
        [BASE, BASE, "default"],
    ],
)
@pytest.mark.parametrize("shape", [(), (1,)])  # decode rows [T, in], prompt tokens [T, 1, in]
def test_routed_rows_are_peft_mixed_batch_and_do_not_depend_on_their_batch(
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
            torch.testing.assert_close(got, expected)
            # each row's delta alone: the same bits as among the others (PEFT's F.linear gives
            # other last bits by the number of rows an adapter has; the base product, oneDNN's in
            # the engine, is not this test's)
            deltas = torch.zeros_like(expected)
            rows.add(layer, x, deltas)
            for i, name in enumerate(names):
                alone = torch.zeros_like(expected[i : i + 1])
                alone_rows = LoraRows.of([name], BASE, x.device, whole=whole)
                if alone_rows is not None:
                    alone_rows.add(layer, x[i : i + 1], alone)
                assert torch.equal(alone, deltas[i : i + 1]), (names, whole, i)
        # through the module call, as the runner swaps it in (the hook's adapter_names dropped)
        rows = LoraRows.of(names, BASE, x.device, whole=False)
        assert rows is not None
        vars(layer)["forward"] = functools.partial(routed_forward, layer, rows)
        try:
            assert torch.equal(layer(x, adapter_names=names), routed_forward(layer, rows, x))
        finally:
            del vars(layer)["forward"]
    # the adapters did change their rows (the comparison is not of base products)
    assert not torch.allclose(expected, layer.base_layer(x))


def test_no_adapter_rows_route_nothing() -> None:
    assert LoraRows.of([BASE, BASE], BASE, torch.device("cpu"), whole=True) is None
    rows = LoraRows.of(["a", BASE, "a"], BASE, torch.device("cpu"), whole=True)
    assert rows is not None and rows.rows["a"] is not None and rows.rows["a"].tolist() == [0, 2]
    whole = LoraRows.of(["a", "a"], BASE, torch.device("cpu"), whole=True)
    assert whole is not None and whole.rows == {"a": None}
