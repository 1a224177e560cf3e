"""flatten_gradients / layer_numel against real JAX (CPU)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

from producer.adapters.jax import (
    _local_part,
    flatten_gradients,
    layer_numel,
    path_name,
)
from producer.summary import summarize

jnp = jax.numpy


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> Any:
    return jnp.asarray(rng.standard_normal(shape), dtype=jnp.float32)


def flax_like_params(seed: int = 0) -> dict[str, Any]:
    """The pytree layout of a Flax linen MLP: {"params": {"Dense_i": {kernel, bias}}}."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "Dense_0": {"kernel": normal(rng, (4, 8)), "bias": jnp.zeros(8)},
            "Dense_1": {"kernel": normal(rng, (8, 2)), "bias": jnp.zeros(2)},
            "LayerNorm_0": {"scale": jnp.ones(8), "bias": jnp.zeros(8)},
        }
    }


def loss_fn(params: dict[str, Any], x: Any, y: Any) -> Any:
    p = params["params"]
    h = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    mu = h.mean(-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
    h = jnp.tanh(h * p["LayerNorm_0"]["scale"] + p["LayerNorm_0"]["bias"])
    out = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
    return jnp.mean((out - y) ** 2)


def test_flax_like_gradients_flatten_to_dotted_names() -> None:
    params = flax_like_params()
    rng = np.random.default_rng(1)
    x, y = normal(rng, (16, 4)), normal(rng, (16, 2))
    grads = jax.jit(jax.grad(loss_fn))(params, x, y)
    flat = flatten_gradients(grads)
    names = [
        "Dense_0.bias", "Dense_0.kernel", "Dense_1.bias", "Dense_1.kernel",
        "LayerNorm_0.bias", "LayerNorm_0.scale",
    ]  # pytree order: dict keys sorted
    assert list(flat) == names
    assert layer_numel(params) == {
        "Dense_0.bias": 8, "Dense_0.kernel": 32, "Dense_1.bias": 2, "Dense_1.kernel": 16,
        "LayerNorm_0.bias": 8, "LayerNorm_0.scale": 8,
    }
    for name, arr in flat.items():
        assert isinstance(arr, np.ndarray) and arr.dtype == np.float32
        module, leaf = name.split(".")
        np.testing.assert_array_equal(arr, np.asarray(grads["params"][module][leaf]))
    s = summarize(flat)
    assert (s.sum_abs > 0).all() and s.nonfinite.sum() == 0


def test_jax_grad_of_a_small_function_is_correct() -> None:
    w = jnp.arange(6.0).reshape(2, 3)
    b = jnp.array([1.0, -2.0])

    def f(tree: dict[str, Any]) -> Any:
        return jnp.sum(tree["w"] ** 2) + 3.0 * jnp.sum(tree["seq"][1])

    grads = jax.grad(f)({"w": w, "seq": [b, b]})
    flat = flatten_gradients(grads)
    assert list(flat) == ["seq.0", "seq.1", "w"]
    np.testing.assert_array_equal(flat["w"], 2 * np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(flat["seq.0"], [0.0, 0.0])
    np.testing.assert_array_equal(flat["seq.1"], [3.0, 3.0])
    s = summarize(flat)
    assert s.sum_abs.tolist() == [0.0, 6.0, 30.0]


class Block(NamedTuple):
    weight: Any
    bias: Any


def test_attribute_sequence_and_params_names() -> None:
    tree = {"layers": [Block(jnp.ones((2, 2)), jnp.ones(2)), (jnp.ones(3),)], "params": 1.0}
    names = list(flatten_gradients(tree))
    assert names == ["layers.0.weight", "layers.0.bias", "layers.1.0", "params"]
    assert list(flatten_gradients({"params": jnp.ones(2)})) == ["params"]  # lone leaf kept
    assert list(flatten_gradients(jnp.ones(3))) == ["params"]  # a bare array
    assert path_name(()) == "params"


def test_one_device_get_for_the_whole_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = jax.device_get

    def counting(tree: Any) -> Any:
        calls.append(len(jax.tree_util.tree_leaves(tree)))
        return original(tree)

    monkeypatch.setattr(jax, "device_get", counting)
    flatten_gradients(flax_like_params())
    assert calls == [6]


def test_dtypes() -> None:
    flat = flatten_gradients({
        "h": jnp.ones(2, jnp.float16), "b": jnp.array([1.5, -2.25], jnp.bfloat16),
        "d": np.ones(2, np.float64),
    })
    assert flat["h"].dtype == np.float16 and flat["d"].dtype == np.float64
    assert flat["b"].dtype == np.float32 and flat["b"].tolist() == [1.5, -2.25]
    with pytest.raises(TypeError, match=r"'i'.*int32"):
        flatten_gradients({"i": jnp.ones(2, jnp.int32)})


def test_errors() -> None:
    with pytest.raises(ValueError, match="no array leaves"):
        flatten_gradients({})
    with pytest.raises(ValueError, match=r"'a\.b'"):
        flatten_gradients({"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
    with pytest.raises(ValueError, match="no elements"):
        layer_numel({"e": jnp.ones((0, 3))})


def test_layer_numel_needs_no_values() -> None:
    shapes = {"params": {"w": jax.ShapeDtypeStruct((3, 5), jnp.float32), "b": jnp.ones(5)}}
    assert layer_numel(shapes) == {"b": 5, "w": 15}


class _Shard(NamedTuple):
    data: Any
    replica_id: int


class _NotAddressable:
    """What a multi-process global array looks like from one process."""

    is_fully_addressable = False

    def __init__(self, shards: list[_Shard]) -> None:
        self.addressable_shards = shards


def test_multiprocess_arrays_contribute_replica_zero_shards() -> None:
    leaf = _NotAddressable([
        _Shard(jnp.ones((2, 2)), 0), _Shard(jnp.full((2, 2), 2.0), 1), _Shard(jnp.arange(2.0), 0)
    ])
    np.testing.assert_array_equal(np.asarray(_local_part(leaf)), [1, 1, 1, 1, 0, 1])
    assert _local_part(_NotAddressable([_Shard(jnp.ones(2), 1)])) is None
    plain = jnp.ones(3)
    assert _local_part(plain) is plain


def test_with_the_real_gradient_producer(kafka_bootstrap: str, unique_name: str) -> None:
    from producer import GradientProducer

    params = flax_like_params()
    grads = jax.jit(jax.grad(loss_fn))(params, jnp.ones((2, 4)), jnp.zeros((2, 2)))
    with GradientProducer(f"jax-{unique_name}", bootstrap_servers=kafka_bootstrap,
                          topic=f"adapters-jax-{unique_name}") as producer:
        producer.start_run(layer_numel(params))
        producer.record_step(0, flatten_gradients(grads))
        assert producer.finish_run(timeout=60)
        stats = producer.stats()
    assert stats.recorded == 1 and stats.sent == 3 and stats.failed == 0
