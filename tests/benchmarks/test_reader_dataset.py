"""``reader_eval dataset``: the tuning sets' candidate rows as one reader dataset (no features),
the same bytes each time; a test set is refused, so no reader trains on what it is measured on.
Rows written for the test, not a set's questions."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.answers.reader_eval import out_of_set, reader_dataset
from benchmarks.answers.sets import chosen_sets


def _rows(folder: Path, name: str, n: int) -> None:
    rows = [
        {
            "question": f"Where is the relay's key {k}?",
            "sentence": f"The key {k} lives in the relay folder.",
            "context": "Relay > Keys",
            "label": k % 2,
            "group": name,
            "source": f"{name}/q{k}",
            "features": {"cos_sentence": 0.5},
        }
        for k in range(n)
    ]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_tuning_sets_rows_make_one_dataset_and_a_test_set_is_refused(tmp_path: Path) -> None:
    tuning = chosen_sets("tuning")[:2]
    for k, name in enumerate(tuning):
        _rows(tmp_path, name, 3 + k)
    out = tmp_path / "reader.jsonl.gz"
    assert reader_dataset(tmp_path, tuning, out) == 7
    rows = [json.loads(line) for line in gzip.decompress(out.read_bytes()).decode().splitlines()]
    assert [r["group"] for r in rows] == [tuning[0]] * 3 + [tuning[1]] * 4
    assert all("features" not in r and set(r) >= {"question", "sentence", "label"} for r in rows)
    first = out.read_bytes()
    reader_dataset(tmp_path, tuning, out)
    assert out.read_bytes() == first  # no time stamp in the gzip header

    test = chosen_sets("test")[0]
    _rows(tmp_path, test, 2)
    with pytest.raises(SystemExit, match=f"{test} is a test set"):
        reader_dataset(tmp_path, [tuning[0], test], tmp_path / "mixed.jsonl")
    assert not (tmp_path / "mixed.jsonl").exists()


def test_the_out_of_set_readers_are_refused_a_test_set_before_anything_trains(tmp_path: Path) -> None:
    test = chosen_sets("test")[0]
    with pytest.raises(SystemExit, match=f"loso: {test}: the default reader never trained on a test set"):
        out_of_set(tmp_path / "cache", [chosen_sets("tuning")[0], test], tmp_path / "readers")
    assert not (tmp_path / "readers").exists()
