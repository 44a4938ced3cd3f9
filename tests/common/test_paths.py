from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import InvalidRequest
from services.common.paths import resolve_under_roots, safe_filename


def test_inside_root_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    roots = [tmp_path / "models"]
    assert resolve_under_roots(str(tmp_path / "models" / "m"), roots, param="p") == (
        tmp_path / "models" / "m"
    )
    assert resolve_under_roots("m", roots, param="p") == tmp_path / "models" / "m"


@pytest.mark.parametrize("value", ["/etc/passwd", "../outside", "m/../../outside", ""])
def test_outside_root_is_refused(tmp_path: Path, value: str) -> None:
    (tmp_path / "models").mkdir()
    with pytest.raises(InvalidRequest) as err:
        resolve_under_roots(value, [tmp_path / "models"], param="lora_path")
    assert err.value.param == "lora_path"


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "link").symlink_to("/etc")
    with pytest.raises(InvalidRequest, match="outside the allowed roots"):
        resolve_under_roots(str(root / "link" / "passwd"), [root], param="p")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("report.pdf", "report.pdf"),
        ("../../etc/passwd", "passwd"),
        ("a\\b\\c.txt", "c.txt"),
        ("x<y>.md", "x_y_.md"),
    ],
)
def test_safe_filename(name: str, expected: str) -> None:
    assert safe_filename(name) == expected


@pytest.mark.parametrize("name", ["..", "", "/", "dir/"])
def test_unusable_filename(name: str) -> None:
    with pytest.raises(InvalidRequest):
        safe_filename(name)
