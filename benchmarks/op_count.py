"""How many ops tf_als adds to the traced train step, next to Keras's
LossScaleOptimizer: a deterministic count, no timing.

Without XLA (Keras's `fit` on every CPU and under every `tf.distribute`
strategy) TensorFlow dispatches each op of the step on its own: on a GPU a
kernel launch, however small its tensor. With XLA each op is part of what
XLA compiles and holds. So the count is what a user pays per step where
timing on this CPU cannot show it.

For each model both variants are built from the same weights, compiled
without XLA, and trained one step with `fit` (which builds the optimizer
and metrics); then the model's own `train_step` is traced in a fresh
`tf.function` on one batch, as Keras's `fit` traces it, and its graph is
counted: the nodes of the step's graph plus those of every function in its
library, constants apart. A point is a scaling point of the instrumented
model (`tf_als.points`). Two kinds of counted ops are not dispatched on
their own: those inside a function that XLA compiles (a
`tf.function(jit_compile=True)` the step calls), which run as one program,
and those nothing the step returns or changes needs, which TensorFlow
prunes before the step runs (`live_nodes`). The last column leaves both
out: what a step without XLA dispatches one by one.

Printed: per model, the ops and functions of each variant, tf_als's extra
ops per point (all; without constants; of those, the ones dispatched one
by one), and the op types that account
for the extra, per point. Where tf_als's code names what an op is for
(name scopes `tf_als_<part>`), the extra is also split by part.

    python benchmarks/op_count.py                     # cnn resnet50 gpt2 bert (~3 min)
    python benchmarks/op_count.py --models gpt2 --types 12

`tests/training/test_op_count.py` keeps a ceiling on the count of a small
model, so that no change grows it unseen.
"""

import argparse
import collections
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = ("cnn", "resnet50", "gpt2", "bert")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (its mid-size GPT-2's shape)

# The KerasHub backbones: `overhead.py`'s mid-size GPT-2 shape (4 layers,
# hidden size 256, 128 tokens), under a float32 Dense head; batch 2.
BACKBONE = overhead.GPT2_MID
_PART = re.compile(r"tf_als_([a-z_]+?)(?:_\d+)?(?:/|$)")


def build(name):
    """(model, loss, x, y) with random weights, under mixed_float16."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "cnn":
        inputs = keras.Input((16, 16, 3))
        x = inputs
        for width in (8, 16, 32):
            x = keras.layers.Conv2D(width, 3, padding="same")(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(10, dtype="float32")(x)
        model = keras.Model(inputs, outputs)
        data = rng.normal(size=(4, 16, 16, 3)).astype("float32")
        return model, loss, data, rng.integers(0, 10, size=(4,))
    if name == "resnet50":
        model = keras.applications.ResNet50(
            weights=None, input_shape=(32, 32, 3), classes=10,
            classifier_activation=None,
        )
        data = rng.normal(size=(2, 32, 32, 3)).astype("float32")
        return model, loss, data, rng.integers(0, 10, size=(2,))
    import keras_hub

    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(dropout=0.0, **BACKBONE)
        pooled = keras.layers.GlobalAveragePooling1D()(backbone(backbone.input))
    elif name == "bert":
        backbone = keras_hub.models.BertBackbone(dropout=0.0, **BACKBONE)
        pooled = backbone(backbone.input)["pooled_output"]
    else:
        raise ValueError(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
    outputs = keras.layers.Dense(2, dtype="float32")(pooled)
    model = keras.Model(backbone.input, outputs)
    length = BACKBONE["max_sequence_length"]
    tokens = rng.integers(0, BACKBONE["vocabulary_size"], size=(2, length))
    x = {
        "token_ids": tokens.astype("int32"),
        "padding_mask": np.ones((2, length), "int32"),
        "segment_ids": np.zeros((2, length), "int32"),
    }
    x = {key: value for key, value in x.items() if key in backbone.input}
    return model, loss, x, rng.integers(0, 2, size=(2,))


def traced_step(variant, name):
    """(graph_def of the traced train step, its fetches, number of
    scaling points)."""
    import keras
    import tensorflow as tf

    import tf_als

    keras.mixed_precision.set_global_policy("mixed_float16")
    model, loss, x, y = build(name)
    inner = keras.optimizers.SGD(1e-3)
    if variant == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
        points = 0
    else:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(inner)
        points = len(tf_als.points(model))
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    model.fit(x, y, batch_size=len(y), epochs=1, verbose=0)
    data = (tf.nest.map_structure(tf.convert_to_tensor, x), tf.convert_to_tensor(y))
    step = tf.function(model.train_step, reduce_retracing=True)
    return (*graph_and_fetches(step.get_concrete_function(data).graph), points)


def graph_and_fetches(graph):
    """(graph_def, names of the nodes the traced function's outputs and
    side effects are) of a `tf.function`'s traced graph."""
    fetches = [t.op.name for t in graph.outputs] + [op.name for op in graph.control_outputs]
    return graph.as_graph_def(), fetches


def live_nodes(graph_def, fetches):
    """{(function name, or None for the step's own graph, node name)} of
    the nodes that run: those the step's outputs and side effects
    (`fetches`) need, through the functions the needed nodes call (their
    returns and side effects). TensorFlow prunes the rest before the step
    runs (zeros the tape makes for inputs no one reads, a product a later
    op replaces). Both branches of a conditional count."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    live, entered = set(), set()

    def walk(scope, nodes, roots):
        todo = list(roots)
        while todo:
            name = todo.pop()
            if name not in nodes or (scope, name) in live:
                continue
            live.add((scope, name))
            node = nodes[name]
            todo += [ref.lstrip("^").split(":")[0] for ref in node.input]
            for attr in node.attr.values():
                called = [attr.func.name] if attr.HasField("func") else []
                for function_name in called + [f.name for f in attr.list.func]:
                    if function_name in functions and function_name not in entered:
                        entered.add(function_name)
                        function = functions[function_name]
                        walk(
                            function_name,
                            {n.name: n for n in function.node_def},
                            [r.split(":")[0] for r in function.ret.values()]
                            + list(function.control_ret.values()),
                        )

    walk(None, {n.name: n for n in graph_def.node}, fetches)
    return live


def count(graph_def, fetches):
    """{"ops": Counter of op types (constants included), "functions": n,
    "parts": Counter of tf_als parts (non-constant ops), "places": Counter
    of where the other non-constant ops sit, "dispatched": how many
    non-constant ops run one by one: live (`live_nodes`) and outside the
    functions XLA compiles} of a step."""
    ops, parts, places = collections.Counter(), collections.Counter(), collections.Counter()
    live = live_nodes(graph_def, fetches)
    nodes = [(n.name, n.op, False, (None, n.name) in live) for n in graph_def.node]
    for function in graph_def.library.function:
        inside = function.attr["_XlaMustCompile"].b
        scope = function.signature.name
        nodes += [
            (n.name, n.op, inside, (scope, n.name) in live) for n in function.node_def
        ]
    dispatched = 0
    for node_name, op, inside, runs in nodes:
        ops[op] += 1
        if op == "Const":
            continue
        dispatched += runs and not inside
        found = _PART.search(node_name)
        if found:
            parts[found.group(1)] += 1
        else:
            places[_place(node_name)] += 1
    return {"ops": ops, "functions": len(graph_def.library.function),
            "parts": parts, "places": places, "dispatched": dispatched}


def _place(node_name):
    """Where an op no tf_als part names sits: the backward pass (TensorFlow
    names gradient ops under `gradient_tape/`), the optimizer, or the
    forward pass and the rest."""
    if "gradient_tape" in node_name or node_name.startswith("gradients"):
        return "backward"
    if "optimizer" in node_name or "sgd" in node_name.lower():
        return "optimizer"
    return "forward"


def measure(name):
    """Both variants' counts of model `name`, each built in this process
    (the graphs are counted, not run, so they do not disturb each other)."""
    keras_def, keras_fetches, _ = traced_step("keras", name)
    als_def, als_fetches, points = traced_step("tf_als", name)
    return {"keras": count(keras_def, keras_fetches),
            "tf_als": count(als_def, als_fetches), "points": points}


def report(name, result, types):
    """Lines of text for one model."""
    k, a, points = result["keras"], result["tf_als"], result["points"]
    k_ops, a_ops = sum(k["ops"].values()), sum(a["ops"].values())
    extra = a_ops - k_ops
    extra_nonconst = extra - (a["ops"]["Const"] - k["ops"]["Const"])
    dispatched = a["dispatched"] - k["dispatched"]
    lines = [
        f"| {name} | {points} | {k_ops:,} | {a_ops:,} | {extra / points:.0f} "
        f"| {extra_nonconst / points:.0f} | {dispatched / points:.0f} "
        f"| {k['functions']} / {a['functions']} |"
    ]
    diff = {op: a["ops"][op] - k["ops"][op] for op in set(a["ops"]) | set(k["ops"])}
    top = sorted(diff.items(), key=lambda item: -abs(item[1]))[:types]
    detail = ", ".join(f"{op} {n / points:+.1f}" for op, n in top if n)
    lines.append(f"  extra per point by op type: {detail}")
    places = ", ".join(
        f"{place} {(a['places'][place] - k['places'][place]) / points:+.1f}"
        for place in ("forward", "backward", "optimizer")
    )
    lines.append(f"  extra per point outside tf_als's named parts: {places}")
    if a["parts"]:
        by_part = ", ".join(
            f"{part} {n / points:.1f}" for part, n in a["parts"].most_common()
        )
        lines.append(f"  tf_als's named parts per point (constants apart): {by_part}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--types", type=int, default=10,
                        help="how many op types to list per model (default 10)")
    args = parser.parse_args(argv)
    print("| model | points | Keras: ops | tf_als: ops | extra ops per point "
          "| of which not constants | of those, dispatched one by one "
          "| functions, Keras / tf_als |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    notes = []
    for name in args.models:
        lines = report(name, measure(name), args.types)
        print(lines[0], flush=True)
        notes += [f"{name}:"] + lines[1:]
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    sys.exit(main())
