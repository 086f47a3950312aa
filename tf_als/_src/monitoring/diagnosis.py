"""What `diagnose` returns: a `Diagnosis`, a `LayerReport` per scaling
point with weight gradients of its own, and the printed table."""

import dataclasses
from typing import Optional

from tf_als._src.monitoring import forward_overflow
from tf_als._src.monitoring import passes

@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One scaling point's row of a `Diagnosis`.

    Attributes:
        point: the scaling point's name (as `tf_als.scales` reports it).
        layer: the layer's name.
        keras_underflow: fraction of the layer's weight-gradient elements
            that are exactly zero with Keras's loss scaling but nonzero in
            float32 (flushed to zero by underflow). Float32 values below
            2**-23 times the row's largest are float32's own rounding
            residue and do not count.
        keras_error: relative error |g - g32| / |g32| of those gradients.
        als_underflow, als_error: the same with tf_als.
        als_scale: the per-layer scale tf_als picked on this batch.
        als_cumulative_scale: T_in, the scale the layer's gradients carry.
    """

    point: str
    layer: str
    keras_underflow: float
    keras_error: float
    als_underflow: float
    als_error: float
    als_scale: float
    als_cumulative_scale: float


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The report `diagnose` returns (and prints).

    Attributes:
        rows: one `LayerReport` per scaling point with trainable weights of
            its own (the weighted layers inside opened composites each
            have theirs), in the order of `tf_als.points`.
        keras_loss_scale: the global scale at which Keras's loss scaling gave
            finite gradients (it starts at 2**15 and halves, as in
            training), or None if no scale did.
        als_loss_scale: the same for tf_als.
        non_finite: what was not finite and where, when the loss or the
            gradients at the starting scale were not finite; else None.
        no_gradient: paths of the trainable variables the loss does not
            reach (no gradient in float32 either).
        forward_overflow: set when both scalings leave more than half of
            some point's weight gradients at zero where float32's are not,
            and the cause is an overflow in the float16 forward pass, not
            underflow (no loss scale brings those gradients back). It is
            the path of the first layer whose float16 output is inf or off
            from float32's by more than 2**-4 (relative norm) while its
            inputs are not (a sum or square inside it overflowed); else of
            the first whose float16 output is inf or within a factor 2**4
            of 65504 (at least 4094) while its float32 output is finite;
            else `"loss"` when every layer agrees but the float16 loss is
            off from float32's by more than 2**-4, as a loss that sums
            float16 outputs is. None otherwise.
            `overflow_advice()` says what to do.
        float16_failures: `(layer path, reason)` of each layer whose
            float16 arithmetic fails on the batch, in the order found: the
            layers tf_als's first-batch check promotes to float32 in `fit`
            (the same search). Empty when none does.
        failure_advice: for each of `float16_failures`, the fix by hand as
            Keras 3 applies it (for a layer made of sublayers, how to reach
            them).
    """

    rows: tuple
    keras_loss_scale: Optional[float]
    als_loss_scale: Optional[float]
    non_finite: Optional[str]
    no_gradient: tuple = ()
    forward_overflow: Optional[str] = None
    float16_failures: tuple = ()
    failure_advice: tuple = ()

    def underflowing(self, threshold: float = 0.01, scaling: str = "keras") -> list:
        """Points where a scaling flushes more than `threshold` of the
        weight-gradient elements that are nonzero in float32.

        Zeros that an overflow in the forward pass causes count too: check
        `forward_overflow` first.

        Args:
            threshold: float in [0, 1).
            scaling: `"keras"` (Keras's global loss scale) or `"tf_als"`.
        """
        if scaling not in ("keras", "tf_als"):
            raise ValueError(
                f'`scaling` must be "keras" or "tf_als"; received {scaling!r}.'
            )
        field = "keras_underflow" if scaling == "keras" else "als_underflow"
        return [r.point for r in self.rows if getattr(r, field) > threshold]

    def overflow_advice(self) -> Optional[str]:
        """What `forward_overflow` means and the fix, or None when it is None.

        Example:

        >>> report = Diagnosis((), 1.0, 1.0, None, forward_overflow="loss")
        >>> report.overflow_advice()[:36]
        'Not underflow: overflow in the loss.'
        """
        if self.forward_overflow is None:
            return None
        zeros = (
            "Float16 gradients are zero where float32's are not because the "
            "float16 forward pass overflows, and no loss scale brings them back"
        )
        if self.forward_overflow == forward_overflow.LOSS_ONLY:
            return (
                f"Not underflow: overflow in the loss. {zeros}: every layer "
                "output agrees with float32's, the float16 loss does not (a "
                "sum over float16 outputs that passes 65504 does this). "
                "Compute the loss in float32: cast the predictions first, "
                'y_pred = tf.cast(y_pred, "float32").'
            )
        return (
            f"Not underflow: overflow in the forward pass. {zeros}: layer "
            f"{self.forward_overflow!r} is the first whose float16 output is "
            "inf or off from float32's by more than 2**-4 while its inputs "
            "are not (else, within a factor 16 of 65504). Give that layer "
            "dtype='float32' (its weights are float32 already), and the layers "
            "after it until the values are back within float16's range."
        )

    def __str__(self):
        width = max([len("scaling point")] + [len(r.point) for r in self.rows])
        header = (
            f"{'scaling point':<{width}} {'keras underflow':>15} {'keras error':>11}"
            f" {'tf_als underflow':>16} {'tf_als error':>12} {'tf_als scale':>12}"
        )
        lines = [
            "tf_als precision report: weight gradients vs float32, one batch",
            f"global loss scale: keras {_describe_scale(self.keras_loss_scale)}, "
            f"tf_als {_describe_scale(self.als_loss_scale)}",
            header,
            "-" * len(header),
        ]
        for r in self.rows:
            lines.append(
                f"{r.point:<{width}} {r.keras_underflow:>15.2%} "
                f"{r.keras_error:>11.2e} {r.als_underflow:>16.2%} "
                f"{r.als_error:>12.2e} {r.als_scale:>12g}"
            )
        if self.no_gradient:
            lines.append(
                "no gradient (the loss does not reach these variables): "
                + ", ".join(self.no_gradient)
            )
        if self.non_finite:
            lines.append(self.non_finite)
        for (layer, reason), advice in zip(self.float16_failures, self.failure_advice):
            if self.non_finite is None or layer not in self.non_finite:
                lines.append(f"Layer {layer!r} fails in float16 ({reason}). {advice}")
        if self.forward_overflow is not None:
            lines.append(self.overflow_advice())
        return "\n".join(lines)


def _describe_scale(scale):
    if scale is None:
        return f"none (not finite at any scale down to 2**{15 - passes.MAX_HALVINGS})"
    return f"{scale:g}"
