"""Layer selection by glob patterns (producer.selection)."""

import pytest

from producer.selection import select_names


def test_select_names() -> None:
    names = ["a.w", "a.b", "b.w", "a.x.w"]
    assert select_names(names) == names
    assert select_names(names, include="a.*") == ["a.w", "a.b", "a.x.w"]
    assert select_names(names, include=["*.w"], exclude=["a.x.*"]) == ["a.w", "b.w"]
    assert select_names(names, exclude="*") == []
    assert select_names(["A.w"], include="a.*") == []  # case-sensitive
    with pytest.raises(TypeError, match="str"):
        select_names(names, include=[1])  # type: ignore[list-item]
