"""What the demo prints: a line per finished run (`progress`), a Markdown
table per part, and the sentences that say what the tables show."""

import math
import types

RUNS = ("float32", "keras", "tf_als")


RUN_TITLES = types.MappingProxyType({
    "float32": "float32",
    "keras": "float16, Keras LossScaleOptimizer",
    "tf_als": "float16, tf_als",
})


# How close tf_als's held-out result must come to float32's for the
# closing sentences to call it "float32's": the demo's test asserts it too.
ACCURACY_TOLERANCE = 0.02  # digits: test accuracy, absolute


R2_TOLERANCE = 0.01  # prices: test R2, absolute


def r2(y, predictions):
    """The coefficient of determination, 1 - SS_res / SS_tot, in float64;
    NaN when a prediction is not finite."""
    import numpy as np

    y = np.asarray(y, "float64")
    predictions = np.asarray(predictions, "float64")
    if not np.all(np.isfinite(predictions)):
        return float("nan")
    return float(1.0 - np.sum((y - predictions) ** 2) / np.sum((y - y.mean()) ** 2))


def progress(part, run, result):
    """One line for a finished run."""
    head = f"{part:<9} {RUN_TITLES[run]:<34} done in {result['seconds']:4.0f} s, "
    if part == "underflow":
        line = head + f"test accuracy {result['test_accuracy']:.3f}"
        return line + _said(result)
    line = head + f"test R2 {_r2_text(result['test_r2'])}"
    if result["skipped_steps"]:
        line += f", {result['skipped_steps']} of {result['steps']} steps skipped"
    if result["promoted"]:
        line += f", promoted to float32: {', '.join(result['promoted'])}"
    return line + _said(result)


def _said(result):
    """The first sentence of each of tf_als's warnings, a line each (the
    whole messages are in results.json)."""
    return "".join(
        f"\n    tf_als said: {message.split('. ')[0].rstrip('.')}."
        for message in result["warnings"]
    )


def _r2_text(value):
    return f"{value:.4f}" if math.isfinite(value) else "not finite"


def _pow2(value):
    if value <= 0:
        return "0"
    exponent = math.log2(value)
    return f"2**{exponent:.0f}" if exponent == round(exponent) else f"{value:g}"


def underflow_table(results):
    """Part 1's Markdown table."""
    lines = [
        "| run | test accuracy | test loss | worst layer | its underflow | "
        "its gradient error | skipped steps | CPU time a step vs Keras |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    base = results["keras"]["step_seconds"]
    for run in RUNS:
        r = results[run]
        lines.append(
            f"| {RUN_TITLES[run]} | {r['test_accuracy']:.4f} | {r['test_loss']:.4f} | "
            f"{r['worst_layer'] or '-'} | {r['worst_underflow']:.1%} | "
            f"{r['worst_gradient_error']:.1%} | {r['skipped_steps']} of {r['steps']} | "
            f"{r['step_seconds'] / base:.2f}x |"
        )
    return "\n".join(lines)


def failure_table(results):
    """Part 2's Markdown table."""
    lines = [
        "| run | test R2 | skipped steps | final loss scale | layers promoted to float32 |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for run in RUNS:
        r = results[run]
        lines.append(
            f"| {RUN_TITLES[run]} | {_r2_text(r['test_r2'])} | "
            f"{r['skipped_steps']} of {r['steps']} | "
            f"{_pow2(r['loss_scale']) if run != 'float32' else '-'} | "
            f"{', '.join(r['promoted']) or '-'} |"
        )
    return "\n".join(lines)


def underflow_summary(results):
    """What part 1's table shows, from its own numbers."""
    keras_run, als = results["keras"], results["tf_als"]
    layer = keras_run["worst_layer"]
    underflow, error = keras_run["layers"][layer]
    als_underflow, als_error = als["layers"][layer]
    accuracies = [results[run]["test_accuracy"] for run in RUNS]
    spread = max(accuracies) - min(accuracies)
    accuracy = (
        f"Test accuracy differs by {spread:.1%} at most between the three "
        "runs: on this model the lost gradients do not change the result."
        if spread <= ACCURACY_TOLERANCE
        else f"Test accuracy: float32 {accuracies[0]:.3f}, Keras "
        f"{accuracies[1]:.3f}, tf_als {accuracies[2]:.3f}."
    )
    return (
        f"Underflow: the worst layer under Keras's global scale "
        f"({_pow2(keras_run['loss_scale'])}) is {layer}: {underflow:.0%} of its "
        f"weight-gradient elements that float32 resolves arrive as exact "
        f"zeros (underflow) and the gradient applied is {error:.0%} off "
        f"float32's (gradient error: |g16 - g32| / |g32| over the layer's "
        f"weights; both at each run's final weights, mean of 4 held-out "
        f"batches). With its own scale under tf_als the same layer has "
        f"{als_underflow:.1%} and {als_error:.1%}. {accuracy}"
    )


def failure_summary(results):
    """What part 2's table shows, from its own numbers."""
    f32, keras_run, als = results["float32"], results["keras"], results["tf_als"]
    ended = (
        "its predictions are not finite"
        if not math.isfinite(keras_run["test_r2"])
        else f"its test R2 is {keras_run['test_r2']:.4f}"
    )
    promoted = ", ".join(als["promoted"]) or "no layer"
    return (
        f"Failure: every price is above 65504, float16's largest value, so "
        f"no loss scale helps the float16 output layer. Keras skipped "
        f"{keras_run['skipped_steps']} of {keras_run['steps']} steps, its "
        f"scale fell to {_pow2(keras_run['loss_scale'])} and {ended}. tf_als "
        f"promoted {promoted} to float32, skipped {als['skipped_steps']} "
        f"steps and reached a test R2 of {_r2_text(als['test_r2'])} "
        f"(float32: {_r2_text(f32['test_r2'])})."
    )
