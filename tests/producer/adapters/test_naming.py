"""normalize_name: wrapper components removed anywhere, idempotent, collisions detected."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer.adapters.naming import WRAPPER_COMPONENTS, normalize_name, normalized_names

_WRAPPERS = sorted(WRAPPER_COMPONENTS)
# Plain path components: identifiers and digits that are never a wrapper component.
_component = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}|[0-9]{1,3}", fullmatch=True).filter(
    lambda c: c not in WRAPPER_COMPONENTS
)
_plain_name = st.lists(_component, min_size=1, max_size=6).map(".".join)


@st.composite
def _wrapped(draw: st.DrawFn) -> tuple[str, str]:
    """(plain name, the same name with wrapper components inserted before any component
    but the last, possibly several at one position)."""
    parts = draw(st.lists(_component, min_size=1, max_size=6))
    out: list[str] = []
    for part in parts[:-1]:
        out.extend(draw(st.lists(st.sampled_from(_WRAPPERS), max_size=3)))
        out.append(part)
    out.extend(draw(st.lists(st.sampled_from(_WRAPPERS), max_size=3)))
    out.append(parts[-1])
    return ".".join(parts), ".".join(out)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("module.fc.weight", "fc.weight"),  # DDP
        ("_orig_mod.fc.weight", "fc.weight"),  # torch.compile
        ("module._orig_mod.0.weight", "0.weight"),  # DDP(compile(model))
        ("_orig_mod.module.0.weight", "0.weight"),  # compile(DDP(model))
        (
            "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.q.weight",
            "layers.0.attn.q.weight",
        ),
        ("layers.3._checkpoint_wrapped_module.mlp.bias", "layers.3.mlp.bias"),
        ("_fsdp_wrapped_module._fpw_module.fc.weight", "fc.weight"),  # old FSDP flattening
        ("encoder.layer.0._orig_mod.dense.weight", "encoder.layer.0.dense.weight"),
        ("mymodule.weight", "mymodule.weight"),  # whole components only
        ("module_list.0.weight", "module_list.0.weight"),
        ("weight", "weight"),
        ("module", "module"),  # the last component is the parameter's own name
        ("fc.module", "fc.module"),
    ],
)
def test_examples(raw: str, expected: str) -> None:
    assert normalize_name(raw) == expected


@given(_wrapped())
def test_wrapped_normalizes_to_unwrapped(pair: tuple[str, str]) -> None:
    plain, wrapped = pair
    assert normalize_name(wrapped) == plain
    assert normalize_name(plain) == plain


@given(st.text(max_size=40))
def test_idempotent_on_any_string(name: str) -> None:
    once = normalize_name(name)
    assert normalize_name(once) == once


@given(_wrapped(), st.sampled_from(_WRAPPERS))
def test_wrapping_again_changes_nothing(pair: tuple[str, str], wrapper: str) -> None:
    plain, wrapped = pair
    assert normalize_name(f"{wrapper}.{wrapped}") == normalize_name(wrapped) == plain


def test_non_str_rejected() -> None:
    with pytest.raises(TypeError, match="str"):
        normalize_name(3)  # type: ignore[arg-type]


def test_collision_names_both_parameters() -> None:
    with pytest.raises(ValueError, match=r"'a\.module\.w'.*'a\.w'|'a\.w'.*'a\.module\.w'"):
        normalized_names(["a.module.w", "a.w"])
    assert normalized_names(["a.module.w", "a.w"], name_fn=lambda n: n) == ["a.module.w", "a.w"]


def test_name_fn_must_return_str() -> None:
    with pytest.raises(TypeError, match="returned int"):
        normalized_names(["a"], name_fn=lambda n: 1)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="callable"):
        normalized_names(["a"], name_fn=None)  # type: ignore[arg-type]
