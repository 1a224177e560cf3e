"""A small multi-layer perceptron trained with NumPy and hand-written backpropagation.

This is the *real* model the gradstream demo trains: nothing about its gradients is made up.
The data set is scikit-learn's bundled handwritten digits (``sklearn.datasets.load_digits``:
1797 samples, 8x8 = 64 features, 10 classes; offline, shipped inside scikit-learn).

Parameters are named the way PyTorch names the parameters of an ``nn.Sequential`` of
``nn.Linear`` layers stored in a ``layers`` attribute, in model order (input to output)::

    layers.0.weight  (out_0, in_0)     layers.0.bias  (out_0,)
    layers.1.weight  (out_1, out_0)    layers.1.bias  (out_1,)
    ...

so that ``z_l = h_{l-1} @ W_l.T + b_l`` exactly like ``torch.nn.functional.linear``. Hidden
layers use ReLU or the logistic sigmoid; the last layer produces logits and the loss is the
mean softmax cross-entropy over the batch.

Numerics are deliberately *not* sanitised: when training diverges, overflow produces real
``inf``/``nan`` in the loss and in the gradients, which is exactly what gradstream must see.
Floating-point warnings are silenced with :func:`numpy.errstate` instead.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

Activation = Literal["relu", "sigmoid"]
Params = dict[str, np.ndarray]

ACTIVATIONS: tuple[str, ...] = ("relu", "sigmoid")

_PARAM_RE = re.compile(r"^layers\.(\d+)\.(weight|bias)$")


@dataclass(frozen=True)
class Init:
    """A weight-initialisation scheme for :func:`init_params`.

    Attributes:
        kind: ``"he"``, ``"xavier"`` or ``"normal"``.
        std: the standard deviation, used only when ``kind == "normal"``.

    The weight of a layer with ``fan_in`` inputs and ``fan_out`` outputs is drawn from a zero-mean
    normal distribution with standard deviation:

    * ``"he"``: ``sqrt(2 / fan_in)`` (He, Zhang, Ren & Sun 2015, "Delving Deep into Rectifiers",
      eq. 10; keeps the variance of ReLU pre-activations constant across layers);
    * ``"xavier"``: ``sqrt(2 / (fan_in + fan_out))`` (Glorot & Bengio 2010, "Understanding the
      difficulty of training deep feedforward neural networks", eq. 12, normal variant);
    * ``"normal"``: ``std``.

    Biases are initialised to zero in every scheme.
    """

    kind: Literal["he", "xavier", "normal"] = "he"
    std: float = 0.01

    @classmethod
    def parse(cls, spec: str | Init) -> Init:
        """Parse ``"he"``, ``"xavier"`` or ``"normal(0.05)"`` into an :class:`Init`.

        Args:
            spec: the textual form, or an :class:`Init`, which is returned unchanged.

        Returns:
            The initialisation scheme.

        Raises:
            ValueError: for an unknown scheme or a non-positive / non-numeric ``std``.
        """
        if isinstance(spec, Init):
            return spec
        text = spec.strip().lower()
        if text in ("he", "xavier"):
            return cls(kind=text)  # type: ignore[arg-type]
        match = re.fullmatch(r"normal\(\s*([^)]+?)\s*\)", text)
        if match:
            try:
                std = float(match.group(1))
            except ValueError:
                raise ValueError(f"init {spec!r}: std is not a number") from None
            if not std > 0 or not np.isfinite(std):
                raise ValueError(f"init {spec!r}: std must be positive and finite")
            return cls(kind="normal", std=std)
        raise ValueError(f"unknown init {spec!r}: expected 'he', 'xavier' or 'normal(std)'")

    def weight_std(self, fan_in: int, fan_out: int) -> float:
        """The standard deviation of a ``(fan_out, fan_in)`` weight under this scheme.

        Args:
            fan_in: number of inputs of the layer (> 0).
            fan_out: number of outputs of the layer (> 0).

        Returns:
            The standard deviation (formulas and sources in the class docstring).
        """
        if self.kind == "he":
            return float(np.sqrt(2.0 / fan_in))
        if self.kind == "xavier":
            return float(np.sqrt(2.0 / (fan_in + fan_out)))
        return float(self.std)

    def __str__(self) -> str:
        return f"normal({self.std:g})" if self.kind == "normal" else self.kind


def param_names(num_layers: int) -> list[str]:
    """Parameter names of a ``num_layers``-layer MLP in model order.

    Args:
        num_layers: number of linear layers (>= 1).

    Returns:
        ``["layers.0.weight", "layers.0.bias", "layers.1.weight", ...]``.
    """
    return [f"layers.{i}.{kind}" for i in range(num_layers) for kind in ("weight", "bias")]


def init_params(
    layer_sizes: Sequence[int],
    init: str | Init = "he",
    *,
    seed: int | np.random.Generator = 0,
    dtype: npt.DTypeLike = np.float32,
) -> Params:
    """Initialise the parameters of an MLP.

    Args:
        layer_sizes: widths ``[in, hidden_1, ..., out]``; at least two entries, all positive.
            ``len(layer_sizes) - 1`` linear layers are created.
        init: the weight initialisation (see :class:`Init`); biases are zero.
        seed: seed or generator; the same seed gives bit-identical parameters, which is how
            every data-parallel rank starts from the same model.
        dtype: floating dtype of every array (float32 for training, float64 for gradient checks).

    Returns:
        An insertion-ordered dict ``name -> array`` in model order; ``layers.i.weight`` has shape
        ``(layer_sizes[i + 1], layer_sizes[i])`` and ``layers.i.bias`` shape
        ``(layer_sizes[i + 1],)``.

    Raises:
        ValueError: for fewer than two sizes, a non-positive size or a bad ``init``.
    """
    sizes = [int(s) for s in layer_sizes]
    if len(sizes) < 2 or any(s <= 0 for s in sizes):
        raise ValueError(f"layer_sizes must have >= 2 positive entries, got {list(layer_sizes)}")
    scheme = Init.parse(init)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    params: Params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        std = scheme.weight_std(fan_in, fan_out)
        params[f"layers.{i}.weight"] = (rng.standard_normal((fan_out, fan_in)) * std).astype(dtype)
        params[f"layers.{i}.bias"] = np.zeros(fan_out, dtype=dtype)
    return params


def num_layers(params: Mapping[str, np.ndarray]) -> int:
    """Number of linear layers in ``params``, validating the naming and shapes.

    Args:
        params: the parameter dict (see :func:`init_params`).

    Returns:
        L, such that ``layers.0`` .. ``layers.{L-1}`` each have a weight and a bias.

    Raises:
        ValueError: on a foreign name, a missing weight/bias, or inconsistent shapes.
    """
    indices: set[int] = set()
    for name in params:
        match = _PARAM_RE.match(name)
        if not match:
            raise ValueError(f"unexpected parameter name {name!r}")
        indices.add(int(match.group(1)))
    count = len(indices)
    if count == 0 or indices != set(range(count)) or len(params) != 2 * count:
        raise ValueError(f"parameters must be layers.0..layers.N weight+bias, got {list(params)}")
    prev_out: int | None = None
    for i in range(count):
        w, b = params[f"layers.{i}.weight"], params[f"layers.{i}.bias"]
        if w.ndim != 2 or b.shape != (w.shape[0],):
            raise ValueError(f"layers.{i}: weight {w.shape} and bias {b.shape} do not match")
        if prev_out is not None and w.shape[1] != prev_out:
            raise ValueError(f"layers.{i}.weight has {w.shape[1]} inputs, expected {prev_out}")
        prev_out = w.shape[0]
    return count


def _sigmoid(z: np.ndarray) -> np.ndarray:
    # 1 / (1 + e^-z); for very negative z, exp overflows to inf and the result is exactly 0.
    return 1.0 / (1.0 + np.exp(-z))


def forward(
    params: Mapping[str, np.ndarray], x: np.ndarray, activation: Activation = "relu"
) -> np.ndarray:
    """Logits of the MLP.

    Args:
        params: the parameters (see :func:`init_params`).
        x: inputs, shape ``(batch, in)``; cast to the parameters' dtype.
        activation: hidden-layer activation, ``"relu"`` or ``"sigmoid"``.

    Returns:
        Logits, shape ``(batch, out)``, in the parameters' dtype (may contain inf/nan).

    Raises:
        ValueError: on malformed parameters, a shape mismatch or an unknown activation.
    """
    logits, _ = _forward(params, x, activation)
    return logits


def _forward(
    params: Mapping[str, np.ndarray], x: np.ndarray, activation: str
) -> tuple[np.ndarray, list[np.ndarray]]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: expected one of {ACTIVATIONS}")
    count = num_layers(params)
    dtype = params["layers.0.weight"].dtype
    h = np.asarray(x, dtype=dtype)
    if h.ndim != 2 or h.shape[1] != params["layers.0.weight"].shape[1]:
        raise ValueError(
            f"x has shape {h.shape}, expected (batch, {params['layers.0.weight'].shape[1]})"
        )
    hs = [h]  # hs[l] is the input of layer l; the last entry is the logits
    with np.errstate(all="ignore"):
        for i in range(count):
            z = h @ params[f"layers.{i}.weight"].T + params[f"layers.{i}.bias"]
            if i == count - 1:
                hs.append(z)  # logits
                break
            h = np.maximum(z, 0) if activation == "relu" else _sigmoid(z)
            hs.append(h)
    return hs[-1], hs


def forward_backward(
    params: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    activation: Activation = "relu",
) -> tuple[float, Params]:
    """Mean softmax cross-entropy loss and its gradient with respect to every parameter.

    Vectorised per layer (one matrix product forward, two backward), no per-sample loops.
    With ``z = logits``, ``p = softmax(z)`` and one-hot targets ``t`` over a batch of ``B``:

    * ``loss = (1/B) sum_i [logsumexp(z_i) - z_i[y_i]]`` (log-sum-exp shifted by ``max z_i``);
    * ``dL/dz = (p - t) / B`` (softmax cross-entropy gradient; Bishop 2006, PRML eq. 4.109);
    * for layer ``l`` with input ``h_{l-1}``: ``dL/dW_l = dz_l.T @ h_{l-1}``,
      ``dL/db_l = sum_i dz_l``, ``dL/dh_{l-1} = dz_l @ W_l`` and
      ``dz_{l-1} = dL/dh_{l-1} * f'(z_{l-1})`` with ``relu' = [z > 0]`` and
      ``sigmoid' = s (1 - s)`` (backpropagation, Rumelhart, Hinton & Williams 1986).

    Args:
        params: the parameters (see :func:`init_params`); their dtype (float32, or float64 for
            gradient checks) is the computation dtype.
        x: inputs, shape ``(B, in)``, ``B >= 1``; cast to the parameters' dtype.
        y: integer class labels, shape ``(B,)``, each in ``[0, out)``.
        activation: hidden-layer activation, ``"relu"`` or ``"sigmoid"``.

    Returns:
        ``(loss, grads)``: the loss as a Python float and an insertion-ordered dict with the same
        names, shapes and dtype as ``params``, in model order. Nothing is sanitised: if the
        forward pass overflows, the loss and the gradients carry the real ``inf``/``nan``.

    Raises:
        ValueError: on malformed parameters, mismatched shapes, an empty batch, labels out of
            range or an unknown activation.
    """
    logits, hs = _forward(params, x, activation)
    labels = np.asarray(y)
    batch, classes = logits.shape
    if batch == 0:
        raise ValueError("empty batch")
    if labels.shape != (batch,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"y must be integer labels of shape ({batch},), got {labels.shape}")
    if labels.min() < 0 or labels.max() >= classes:
        raise ValueError(f"labels must lie in [0, {classes})")
    count = len(hs) - 1
    dtype = logits.dtype
    rows = np.arange(batch)
    grads: Params = {}
    with np.errstate(all="ignore"):
        shifted = logits - logits.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        total = exp.sum(axis=1, keepdims=True)
        loss = float(np.mean(np.log(total[:, 0]) - shifted[rows, labels]))
        dz = exp / total
        dz[rows, labels] -= 1
        dz /= dtype.type(batch)
        for i in range(count - 1, -1, -1):
            h_in = hs[i]
            grads[f"layers.{i}.weight"] = (dz.T @ h_in).astype(dtype, copy=False)
            grads[f"layers.{i}.bias"] = dz.sum(axis=0).astype(dtype, copy=False)
            if i > 0:
                dh = dz @ params[f"layers.{i}.weight"]
                dz = dh * (h_in > 0) if activation == "relu" else dh * h_in * (1 - h_in)
    return loss, {name: grads[name] for name in param_names(count)}


@functools.lru_cache(maxsize=2)
def _load_digits_cached(dtype_name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # heavy import: only when the data is needed

    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64)
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    std[std == 0] = 1.0  # three pixels are constant 0 in the whole data set
    features = ((x - mean) / std).astype(dtype_name)
    labels = np.asarray(data.target, dtype=np.int64)
    features.setflags(write=False)
    labels.setflags(write=False)
    return features, labels


def load_digits_dataset(dtype: npt.DTypeLike = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, standardised per feature (z-score over the whole data set).

    ``x_std = (x - mean) / std`` per feature, with ``std`` replaced by 1 for the three pixels that
    are constant in the data set (so they map to 0 instead of nan).

    Args:
        dtype: floating dtype of the features.

    Returns:
        ``(x, y)``: read-only features of shape ``(1797, 64)`` in ``dtype`` and int64 labels of
        shape ``(1797,)`` in ``[0, 10)``. Cached per dtype within a process.

    Raises:
        ImportError: if scikit-learn is not installed (``pip install gradstream[demo]``).
    """
    return _load_digits_cached(np.dtype(dtype).name)


def sgd_update(
    params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], lr: float
) -> None:
    """Plain SGD, in place: ``p <- p - lr * g`` for every parameter (Robbins & Monro 1951).

    Args:
        params: the parameters, updated in place (arrays keep their dtype).
        grads: gradients with the same names and shapes.
        lr: learning rate.

    Raises:
        KeyError: if a gradient is missing.
    """
    with np.errstate(all="ignore"):
        for name, p in params.items():
            p -= p.dtype.type(lr) * grads[name]
