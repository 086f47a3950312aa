"""The private Keras names tf_als relies on (Keras 3.15), in one place.

Each helper says what it reads and the public alternative, if any, so that
a Keras upgrade is checked here and nowhere else.
"""

import contextlib
import copy
import functools
import inspect
import threading
import typing

import keras
import tensorflow as tf
from keras.src.backend.common import masking as _masking
from keras.src.backend.common import stateless_scope as _stateless
from keras.src.models import functional as _functional

# Keras 3.15 `keras.src.models.functional.Functional`: the class of every
# model built from `keras.Input`s; it is not exported (`keras.Model(inputs,
# outputs)` returns one).
Functional = _functional.Functional


def get_mask(x):
    """The Keras mask `x` carries, or None. Keras 3.15 and 3.16
    `keras.src.backend.common.masking.get_keras_mask` (3.15 also re-exports
    it from `keras.src.backend`, 3.16 does not; public: none, layers receive
    masks as arguments)."""
    return _masking.get_keras_mask(x)


def set_mask(x, mask) -> None:
    """Attaches a Keras mask to `x`, as a layer's output carries one.
    Keras 3.15 and 3.16 `keras.src.backend.common.masking.set_keras_mask`."""
    _masking.set_keras_mask(x, mask)


def copy_mask(source, target) -> None:
    """Gives `target` the mask `source` carries (if any)."""
    mask = get_mask(source)
    if mask is not None:
        set_mask(target, mask)


# A nested model called with `training=None` recorded, which Keras 3.16
# hands on to the layers inside it as None, not as the enclosing call's flag.
RECORDED_NONE = "recorded training=None"


def operation_fn(operation, training):
    """The callable `Functional.call` runs a node's operation with, given
    `training`, the flag of the enclosing call. Keras 3.15:
    `keras.src.models.functional.operation_fn`, which sets the flag over
    the one the node recorded. Keras 3.16 (keras-team/keras#23364) has no
    such function: it runs a node with what it recorded and lets
    `Layer.__call__` take the enclosing call's flag where the node
    recorded no `training` at all (`Layer._call_context_args`; a recorded
    `training=None` keeps None there), as done here."""
    if hasattr(_functional, "operation_fn"):  # Keras 3.15
        return _functional.operation_fn(operation, training=training)

    def call(*args, **kwargs):  # Keras 3.16
        takes = "training" in getattr(operation, "_call_context_args", ())
        if takes and training is not None and "training" not in kwargs:
            kwargs["training"] = None if training is RECORDED_NONE else training
        return operation(*args, **kwargs)

    return call


@functools.lru_cache(maxsize=None)
def recorded_training_wins() -> bool:
    """Whether a nested model called `base(x, training=False)` inside a
    Functional model keeps its recorded flag when the outer model is
    called with `training=True` (Keras 3.16, keras-team/keras#23364, as
    Keras 2), rather than taking the outer call's (Keras 3.15,
    keras-team/keras#20285). Read once from Keras by running that very
    case on two tiny models of one weightless layer (explicit names: no
    layer name the user's models would get is taken)."""

    class Flag(keras.layers.Layer):
        def call(self, x, training=None):
            return x * 0.0 + (1.0 if training else 0.0)

    with tf.init_scope():
        inner_in = keras.Input((1,), name="tf_als_flag_inner_input")
        inner = keras.Model(
            inner_in, Flag(name="tf_als_flag")(inner_in), name="tf_als_flag_inner"
        )
        outer_in = keras.Input((1,), name="tf_als_flag_outer_input")
        outer = keras.Model(
            outer_in, inner(outer_in, training=False), name="tf_als_flag_outer"
        )
        seen = outer(tf.ones((1, 1)), training=True)
    return float(tf.reduce_max(seen)) == 0.0


def fill_in(graph_node, values):
    """(args, kwargs) of a `GraphNode`'s call, with its input tensors
    replaced by `values` ({id of the KerasTensor: value}), as
    `Functional.call` fills them. Keras 3.15 `Node.arguments.fill_in`."""
    return graph_node.node.arguments.fill_in(values)


def sequential_graph(model):
    """The Functional graph a built Sequential model runs, or None before
    it is built. Keras 3.15 `Sequential._functional`."""
    return model._functional


class GraphNode(typing.NamedTuple):
    """What tf_als reads of one call in a Functional graph.

    Attributes:
        operation: the layer (or model) called.
        inputs: the KerasTensors passed to it, in call order.
        outputs: the KerasTensors it returned.
        args, kwargs: the call's arguments, KerasTensors included.
        node: the Keras node itself, only to hand back to `fill_in`.
    """

    operation: object
    inputs: tuple
    outputs: tuple
    args: tuple
    kwargs: dict
    node: object


def nodes_by_depth(functional) -> dict:
    """{depth: [GraphNode]} of the calls in a Functional graph (depth 0 at
    the outputs; input placeholders left out). Keras 3.15
    `Functional._nodes_by_depth` and the attributes of
    `keras.src.ops.node.Node` (`operation`, `is_input`, `arguments`,
    `outputs`); public: none."""
    return {
        depth: [
            GraphNode(
                operation=node.operation,
                inputs=tuple(node.arguments.keras_tensors),
                outputs=tuple(node.outputs),
                args=tuple(node.arguments.args),
                kwargs=dict(node.arguments.kwargs),
                node=node,
            )
            for node in nodes
            if node.operation and not node.is_input
        ]
        for depth, nodes in functional._nodes_by_depth.items()
    }


def inputs_struct(functional):
    """The nested structure of a Functional model's inputs. Keras 3.15
    `Functional._inputs_struct` (public `model.inputs` is flat)."""
    return functional._inputs_struct


def outputs_struct(functional):
    """The nested structure of a Functional model's outputs. Keras 3.15
    `Functional._outputs_struct` (public `model.outputs` is flat)."""
    return functional._outputs_struct


def standardize_inputs(functional, inputs) -> list:
    """`inputs` flattened, converted and cast as `Functional.call` does on
    entry. Keras 3.15 `Functional._standardize_inputs`."""
    return functional._standardize_inputs(inputs)


def enter_functional(functional, flat) -> list:
    """What a nested Functional model makes of the flat inputs of one of its
    calls before running its graph (conversion, rank adjustment). Keras
    3.15 `Functional._convert_inputs_to_tensors`, `_adjust_input_rank`."""
    flat = functional._convert_inputs_to_tensors(flat)
    return functional._adjust_input_rank(flat)


def pass_inputs_through(model) -> None:
    """Makes `model.__call__` hand its inputs to `call` as they are given
    (no conversion, non-tensor positional arguments allowed), so they
    reach the layers exactly as they reach the original model. Keras 3.15
    `Layer._convert_input_args`, `_allow_non_tensor_positional_args`."""
    model._convert_input_args = False
    model._allow_non_tensor_positional_args = True


def track(owner, child, name: str) -> None:
    """Tracks `child` as a dependency of `owner` named `name`, for
    `tf.train.Checkpoint` (Keras's own list wrappers are not followed).
    TensorFlow's `Trackable._track_trackable`, which Keras 3.15 layers
    inherit on the TensorFlow backend."""
    owner._track_trackable(child, name=name)


def overwrites_with_gradient(optimizer, variable) -> bool:
    """Whether `optimizer` overwrites `variable` with its "gradient" instead
    of applying it (Keras's LossScaleOptimizer does not divide those by S).
    Keras 3.15 `Optimizer._overwrite_variable_with_gradient`; public: none."""
    return optimizer._overwrite_variable_with_gradient(variable)


def optimizer_variables(optimizer) -> list:
    """The trainable variables `optimizer` was built for, in its order.
    Keras 3.15 `Optimizer._trainable_variables`; public: none."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def apply_calls(optimizer):
    """How many times `optimizer.apply` has applied or accumulated
    gradients (int64 scalar). It is `iterations` without gradient
    accumulation; with `gradient_accumulation_steps=k`, `iterations` counts
    applied steps (this count // k). Keras 3.15 `Optimizer._iterations`;
    public: `iterations * k` only at the start of each group."""
    return tf.cast(tf.convert_to_tensor(optimizer._iterations), tf.int64)


def sublayers(layer, recursive: bool) -> list:
    """The layers tracked inside `layer` (not `layer` itself), in attribute
    order, each once. Keras 3.15 `Layer._flatten_layers`; there is no
    public equivalent for an arbitrary layer (`Model.layers` covers models
    only, and not recursively)."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def draws_random(layer) -> bool:
    """Whether `layer` or a layer inside it holds a `SeedGenerator` (a
    `Dropout`, `GaussianNoise`, a layer of the user's that draws with
    its own seed): two calls on the same inputs may then differ. Keras
    3.15 `Layer._seed_generators`, which its tracker fills on assignment;
    public: none."""
    every = [layer] + sublayers(layer, recursive=True)
    return any(getattr(each, "_seed_generators", None) for each in every)


def serving_specs(model) -> list:
    """The `tf.TensorSpec`s (batch dimension None) of the positional
    arguments `model.export` serves, as Keras derives them: from the inputs
    of a Functional or Sequential model, from the shapes of the first call
    of a subclassed one. Keras 3.15 `keras.src.export.export_utils`
    (`get_input_signature`, `make_tf_tensor_spec`); the public
    `model.export` uses them but does not expose them."""
    from keras.src import tree
    from keras.src.export import export_utils

    return [
        tree.map_structure(
            lambda x: export_utils.make_tf_tensor_spec(x, dynamic_batch=True), arg
        )
        for arg in export_utils.get_input_signature(model)
    ]


def compile_arguments(model):
    """The arguments `model.compile` was last called with (the objects
    themselves, not their configs), or None if `model` is not compiled.
    Keras 3.15 `Trainer._compile_config.config`; the public
    `get_compile_config()` returns serialized copies."""
    if not getattr(model, "compiled", False):
        return None
    config = getattr(model, "_compile_config", None)
    return None if config is None else dict(config.config)


def build_state_before_tracing(model, data_batch) -> None:
    """Creates the optimizer's, compiled metrics' and compiled loss's
    variables of `model` before `fit` traces its train step.

    Without a distribution strategy in scope at `compile`, Keras 3.15 defers
    creating them to the first trace of the train step; a `tf.function`
    whose first trace creates variables is traced a second time, so every
    `fit` set-up traces the whole step twice. Under a strategy Keras builds
    them first (`TensorFlowTrainer._maybe_symbolic_build`); this does the
    same (`Trainer._symbolic_build`, which builds from the shapes and dtypes
    of `data_batch`, an `(x, y, sample_weight)` structure of arrays or
    `tf.TensorSpec`s). No public equivalent: `model.build_from_config` does
    not build metrics or the optimizer."""
    if getattr(model, "_distribute_strategy", None) is not None:
        return  # Keras builds them itself.
    model._symbolic_build(data_batch=data_batch)


def all_layers(model) -> list:
    """`model` and every layer tracked inside it, each once."""
    return [model] + sublayers(model, recursive=True)


@contextlib.contextmanager
def dtype_policy(layers, name):
    """Within this block, every layer of `layers` (input layers excepted)
    computes under the dtype policy `name` (no change for None); the
    policies are restored on exit. Keras 3.15 keeps a layer's policy in
    `Layer._dtype_policy`; the public setter would write into a shared
    `DTypePolicyMap` instead of replacing it, and restoring through it
    would nest the map in itself."""
    if name is None:
        yield
        return
    policy = keras.dtype_policies.get(name)
    saved = [
        (layer, layer._dtype_policy)
        for layer in layers
        if isinstance(layer, keras.layers.Layer)
        and not isinstance(layer, keras.layers.InputLayer)
    ]
    # A nested model built under mixed_float16 may record float16 inputs
    # (a Sequential's inputs take its compute dtype), which Keras casts to
    # on entry: under a float32 policy they are float32 too.
    inputs = []
    if policy.compute_dtype == "float32":
        inputs = [
            x for layer in layers for x in _graph_inputs(layer) if x.dtype == "float16"
        ]
    try:
        for layer, _ in saved:
            layer._dtype_policy = policy
        for x in inputs:
            x._dtype = "float32"  # Keras 3.15 KerasTensor._dtype (immutable API)
        yield
    finally:
        for layer, original in saved:
            layer._dtype_policy = original
        for x in inputs:
            x._dtype = "float16"


def set_dtype_policy(layer, name) -> None:
    """Gives `layer` the dtype policy `name` for good (its sublayers keep
    theirs). Keras 3.15 `Layer._dtype_policy`, replaced rather than set
    through the public setter for the reason `dtype_policy` gives."""
    layer._dtype_policy = keras.dtype_policies.get(name)


def _graph_inputs(layer) -> list:
    """The input KerasTensors of a Functional or built Sequential model (the
    ones Keras converts call arguments to); [] for any other layer. Keras
    3.15 `Sequential._functional`."""
    if isinstance(layer, keras.Sequential):
        layer = layer._functional
    if isinstance(layer, keras.Model) and hasattr(layer, "_inputs_struct"):
        return list(layer.inputs)
    return []


@contextlib.contextmanager
def layer_calls(callback, before=None):
    """Within this block, `callback(layer, inputs, outputs)` runs after
    every `Layer.__call__` this thread makes (innermost calls complete
    first), and `before(layer)`, if given, before it. For eager
    diagnostics only: it patches Keras's `Layer.__call__` for the block
    and restores it on exit; calls from other threads meanwhile run
    Keras's own `__call__` unchanged."""
    original = keras.layers.Layer.__call__
    observed = functools.partial(_observed, original, callback, before)
    calling = _in_this_thread(observed, original)
    keras.layers.Layer.__call__ = calling
    try:
        yield
    finally:
        keras.layers.Layer.__call__ = original


def _observed(original, callback, before, layer, *args, **kwargs):
    if before is not None:
        before(layer)
    outputs = original(layer, *args, **kwargs)
    callback(layer, (args, kwargs), outputs)
    return outputs


def _in_this_thread(replacement, original):
    """`replacement` in the calling thread, `original` in every other: a
    patch made for one block of one thread's work."""
    owner = threading.get_ident()

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if threading.get_ident() == owner:
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    return dispatch


# The random draws `float32_random_draws` redirects: Keras 3.15's TensorFlow
# backend module `keras.src.backend.tensorflow.random`, which `keras.random`,
# `keras.layers.Dropout`, `GaussianNoise`, `GaussianDropout` and the random
# preprocessing layers all reach through `backend.random`.
_FLOAT_DRAWS = ("normal", "uniform", "truncated_normal", "gamma", "binomial", "beta")


@contextlib.contextmanager
def float32_random_draws():
    """Within this block, Keras's random ops give float16 and bfloat16 runs
    the draws a float32 run makes from the same seed.

    TensorFlow's stateless samplers turn the same seed into other values in
    each dtype (a float16 uniform keeps 10 bits of each random word, a
    float32 one 23), so the same `SeedGenerator` state drops other units
    in float16 than in float32 (18% of them differ at rate 0.1). Here a
    16-bit draw is made in float32 and rounded, and `dropout` keeps or drops
    by float32 noise, then scales as it would in the input's dtype. For
    `tf_als.diagnose`, whose float32 and float16 runs must see the same
    masks and noise; it replaces functions of Keras 3.15's
    `keras.src.backend.tensorflow.random` for the block and restores them
    on exit; other threads meanwhile draw as Keras does (public: none;
    `keras.random` takes no sampling dtype)."""
    from keras.src.backend.tensorflow import random as module

    originals = {name: getattr(module, name) for name in _FLOAT_DRAWS + ("dropout",)}

    def in_float32(draw):
        signature = inspect.signature(draw)

        def drawing(*args, **kwargs):
            call = signature.bind(*args, **kwargs)
            dtype = call.arguments.get("dtype")
            if dtype is None or keras.backend.standardize_dtype(dtype) not in (
                "float16", "bfloat16",
            ):
                return draw(*args, **kwargs)
            call.arguments["dtype"] = "float32"
            return tf.cast(draw(*call.args, **call.kwargs), dtype)

        return drawing

    def dropout(inputs, rate, noise_shape=None, seed=None):
        inputs = tf.convert_to_tensor(inputs)
        special = not isinstance(rate, (int, float)) or not 0 < rate < 1
        if special or inputs.dtype not in (tf.float16, tf.bfloat16):
            return originals["dropout"](inputs, rate, noise_shape, seed)
        ones = tf.ones_like(inputs, tf.float32)
        kept = originals["dropout"](ones, rate, noise_shape, seed) != 0
        # As tf.nn.experimental.stateless_dropout scales: 1 / (1 - rate)
        # rounded once to the input's dtype.
        scale = tf.convert_to_tensor(1 / (1 - rate), inputs.dtype)
        return tf.where(kept, inputs * scale, tf.zeros_like(inputs))

    try:
        for name in _FLOAT_DRAWS:
            setattr(module, name, _in_this_thread(in_float32(originals[name]), originals[name]))
        module.dropout = _in_this_thread(dropout, originals["dropout"])
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


@contextlib.contextmanager
def global_seed_state():
    """Yields the state variable of Keras's global `SeedGenerator`, the one
    random ops drawn with `seed=None` advance. Keras makes it on the first
    such draw; if it has none yet, one is made for the block (seed 0,
    leaving Python's random stream alone) and removed on exit, so Keras's
    global state is left as found. Keras 3.15
    `keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR` in
    `keras.src.backend.common.global_state`; public: none."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    key = seed_generator.GLOBAL_SEED_GENERATOR
    existing = global_state.get_global_attribute(key)
    generator = existing or keras.random.SeedGenerator(
        seed=0, name="tf_als_global_seed"
    )
    global_state.set_global_attribute(key, generator)
    try:
        yield generator.state
    finally:
        global_state.set_global_attribute(key, existing)


def default_graph():
    """The graph ops are added to now: inside a `tf.function` being traced,
    its `FuncGraph` (the innermost, within a `tf.cond` branch or loop body).
    TensorFlow 2.21 `tf.compat.v1.get_default_graph`; public: none in TF2
    (a symbolic tensor's `.graph` names the graph of that tensor only, and
    making one adds an op)."""
    return tf.compat.v1.get_default_graph()


def compiled_by_xla() -> bool:
    """Whether the ops made now will be compiled by XLA: the graph being
    traced, or one enclosing it, is a `tf.function(jit_compile=True)`
    (Keras's `fit` with `jit_compile=True`). TensorFlow 2.21
    `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext`;
    public: none (`tf.function`'s `jit_compile` is not readable from the
    code it traces)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(default_graph()))


def eager_and_unrecorded() -> bool:
    """Whether an op made now runs eagerly with nothing that could take its
    gradient: no gradient tape and no forward accumulator of this thread
    records it (a decode loop's call, an evaluation by hand). TensorFlow
    2.21 `tensorflow.python.eager.record.could_possibly_record`; public:
    none. Traced code is never taken for unrecorded: a `tf.function`
    called under a tape differentiates its graph after tracing it."""
    if not tf.executing_eagerly():
        return False
    from tensorflow.python.eager import record

    return not record.could_possibly_record()


def unrecorded():
    """A context in which no gradient tape of this thread records the ops
    made: for measurements nothing differentiates (a tape that records
    the branches of a `tf.cond` makes the cond's trace about twice as
    long). TensorFlow 2.21 `tensorflow.python.eager.record.stop_recording`;
    public: `GradientTape.stop_recording`, one tape at a time, and the
    tapes that record here (Keras's, an enclosing scaling point's) are not
    ours to reach."""
    from tensorflow.python.eager import record

    return record.stop_recording()


class CheckpointOnly:
    """Mixin for a Keras layer or model: its dependencies named in
    `checkpoint_only` (a tuple of names given to `track`) are saved and
    restored by `tf.train.Checkpoint` and left out of SavedModels
    (`tf.saved_model.save`, `model.export`), where they have no role.
    TensorFlow 2.21 `Trackable._trackable_children(save_type)`, which Keras
    3.15's TensorFlow-backend `Layer` overrides too; public: none
    (`tf.train.experimental.PythonState`, the public way to checkpoint
    Python values, warns on every SavedModel save that reaches it)."""

    checkpoint_only = ()

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            for name in self.checkpoint_only:
                children.pop(name, None)
        return children


def export_input_signature(model) -> list:
    """The input signature `model.export` serves when given none: from the
    inputs of a Functional or Sequential model, from the shapes of the
    first call of a subclassed one. Keras 3.15
    `keras.src.export.export_utils.get_input_signature`; public: none
    (`model.export` uses it without exposing it)."""
    from keras.src.export import export_utils

    return export_utils.get_input_signature(model)


# Keras 3.15's `Layer` and `Trainer` containers an instance keeps for
# itself: the tracker's lists, the losses, TensorFlow's checkpoint
# dependencies. A copy of a model's state gets copies of them (`fork`).
_OWN_CONTAINERS = (
    "_layers", "_trainable_variables", "_non_trainable_variables", "_metrics",
    "_seed_generators", "_losses", "_loss_ids", "_losses_override", "_tracked",
    "_self_unconditional_checkpoint_dependencies",
    "_self_unconditional_dependency_names",
    "_self_unconditional_deferred_dependencies",
    "_self_name_based_restores", "_self_saveable_object_factories",
)
# What `compile` and `fit` left on a model, which a fresh model has not.
_TRAINING_ATTRIBUTES = (
    "optimizer", "_compile_config", "_compiled_trainable_state", "history",
    "stop_training", "_eval_epoch_iterator", "_predict_epoch_iterator",
)


def fork(model, cls):
    """A new instance of `cls` (a subclass of `type(model)`) holding
    `model`'s state: the same layers, variables, attributes and config
    (its class's methods run on it as on `model`), with containers of its
    own, so that tracking something on one model leaves the other alone,
    and no training state: not compiled, no optimizer, no traced steps.
    `cls.__init__` is not run (its arguments are not known). Keras 3.15
    `Layer._initialize_tracker`, `Tracker.stored_ids`, the tracked
    containers' `tracker`, `Trainer.__init__` and the containers above;
    public: none (`keras.models.clone_model` makes new layers and
    weights)."""
    from keras.src.models import model as model_module

    clone = object.__new__(cls)
    state = dict(vars(model))
    for name in _TRAINING_ATTRIBUTES:
        state.pop(name, None)
    for name in _OWN_CONTAINERS:
        if name in state:
            state[name] = copy.copy(state[name])
    del state["_tracker"]
    vars(clone).update(state)
    tracked = {name: list(getattr(model, name)) for name in _TRACKER_LISTS}
    clone._initialize_tracker()
    for name, values in tracked.items():
        getattr(clone, name).extend(values)
    for key, ids in model._tracker.stored_ids.items():
        clone._tracker.stored_ids[key] = set(ids)
    for name in _OWN_CONTAINERS:
        container = vars(clone).get(name)
        if hasattr(container, "tracker"):
            # TensorFlow's checkpoint dependencies are not Keras state.
            keras_state = not name.startswith("_self_")
            container.tracker = clone._tracker if keras_state else None
    model_module.Trainer.__init__(clone)
    return clone


# The lists `Layer._initialize_tracker` makes (Keras 3.15).
_TRACKER_LISTS = (
    "_trainable_variables", "_non_trainable_variables", "_layers", "_metrics",
    "_seed_generators",
)


def set_untracked(owner, name: str, value) -> None:
    """Sets `owner.name = value` without Keras's or TensorFlow's attribute
    tracking (Keras 3.15 `Layer.__setattr__` would add a layer to
    `owner.layers` and a list to its checkpoint dependencies): for
    tf_als's own attributes of an instrumented model, which must not show
    among the user's layers and weights."""
    object.__setattr__(owner, name, value)


def register_serialized_name(cls, name: str) -> None:
    """Makes Keras write `name` as the `registered_name` of `cls`'s
    instances when it serialises them, while `name` keeps loading what it
    was registered for (no entry when `name` is `cls.__name__`, Keras's
    default). Keras 3.15
    `keras.src.saving.object_registration.GLOBAL_CUSTOM_NAMES`; the public
    `keras.saving.register_keras_serializable` would also make `name` load
    `cls`."""
    from keras.src.saving import object_registration

    if name != cls.__name__:
        object_registration.GLOBAL_CUSTOM_NAMES[cls] = name


@contextlib.contextmanager
def serialized_as(cls, name: str):
    """Within this block, instances of `cls` serialise with the
    `registered_name` `name` (see `register_serialized_name`); the
    previous name is back on exit."""
    from keras.src.saving import object_registration

    names = object_registration.GLOBAL_CUSTOM_NAMES
    previous = names.get(cls)
    names[cls] = name
    try:
        yield
    finally:
        if previous is None:
            names.pop(cls, None)
        else:
            names[cls] = previous


def deserializing(inner_config) -> dict:
    """The whole serialised object (`module`, `class_name`,
    `registered_name`, `build_config`, ...) whose `config` is
    `inner_config`, while Keras deserialises it: Keras 3.15's
    `keras.src.saving.serialization_lib.deserialize_keras_object` hands a
    class's `from_config` the inner config only, and holds the whole one
    as its local `config`. Raises `LookupError` when `from_config` was not
    called from there (public: none)."""
    import inspect

    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "deserialize_keras_object":
            config = frame.f_locals.get("config")
            if isinstance(config, dict) and config.get("config") is inner_config:
                return config
        frame = frame.f_back
    raise LookupError("not called by keras.saving.deserialize_keras_object")


def _h5_store(store):
    """`store` if it is the weights store of a `.keras` file (Keras 3.15
    `keras.src.saving.saving_lib.H5IOStore`); else a ValueError."""
    from keras.src.saving import saving_lib

    if type(store) is not saving_lib.H5IOStore:
        raise ValueError(
            "A model saved by tf_als 0.2-0.5 loads from its `.keras` file "
            "(`keras.models.load_model`); its weights cannot be read from "
            f"a {type(store).__name__}."
        )
    return store


def store_path(store) -> str:
    """The path `store` was last asked for (`store.get(path)`): while a
    saveable's `load_own_variables(store)` runs, the saveable's own path.
    Keras 3.15 `H5IOStore._h5_entry_path`; no public alternative."""
    return _h5_store(store)._h5_entry_path or ""


def store_children(store, path: str) -> list:
    """The names of the groups at `path` in `store`'s file (none if there
    is no group there). Keras 3.15 `H5IOStore.h5_file`."""
    h5_file = _h5_store(store).h5_file
    return list(h5_file[path].keys()) if path in h5_file else []


def translate_store_paths(store, translate) -> None:
    """Makes `store` read what is saved at `translate(path)` whenever Keras
    asks it for `path`, from now on and for the current entry (Keras 3.15
    `saving_lib._load_state` calls `store.get(path)` before each
    saveable's `load_own_variables`, with the same store for every
    saveable of a file). The store is the one a `load_model` call opened
    and closes: nothing else reads through it."""
    store = _h5_store(store)
    get = type(store).get.__get__(store)
    current = store._h5_entry_path or ""
    store.get = lambda path: get(translate(path))
    store.get(current)


def print_message(message) -> None:
    """Prints `message` as Keras prints its own messages: to stdout, or to
    the log when `keras.config.disable_interactive_logging()` was called
    (public: `keras.config.is_interactive_logging_enabled`)."""
    from absl import logging as absl_logging

    if keras.config.is_interactive_logging_enabled():
        print(message)
    else:
        absl_logging.info(message)


def recorded_by_a_tape(values) -> bool:
    """Whether an active `tf.GradientTape` records operations on any of
    `values` (tensors or variables): a backward pass run now is itself
    being differentiated (a gradient taken inside an outer tape's block,
    as a gradient penalty takes it). Decided at trace time. A first-order
    `tape.gradient` runs after its tape's block (Keras's train step, the
    guides' loops) or pops its own non-persistent tape, so it is not.
    TensorFlow 2.21's `tensorflow.python.eager.record`."""
    from tensorflow.python.eager import record

    handles = [v.handle if hasattr(v, "handle") else v for v in values]
    handles = [h for h in handles if tf.is_tensor(h)]
    return bool(handles) and record.should_record_backprop(handles)


def higher_order_possible(values) -> bool:
    """Whether a gradient of a gradient of `values` (tensors or variables)
    may be taken: a persistent tape, or more than one tape, records them,
    or no tape does here (a `tf.function` differentiated after tracing,
    possibly twice). False only where exactly one non-persistent tape
    records them (Keras's train step): its backward pass is not recorded.
    TensorFlow 2.21 `gradients_util.PossibleTapeGradientTypes`; public:
    none."""
    from tensorflow.python.ops import gradients_util

    handles = [v.handle if hasattr(v, "handle") else v for v in values]
    handles = [h for h in handles if tf.is_tensor(h)]
    return gradients_util.PossibleTapeGradientTypes(handles) != (
        gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER
    )


def trainable_weights(layer) -> list:
    """The Keras 3 variables `layer` (with its sublayers) trains, each
    once; [] for None. Public: `Layer.trainable_variables`."""
    if layer is None:
        return []
    return [v for v in layer.trainable_variables if isinstance(v, keras.Variable)]


def read_stored(variable):
    """The value Keras variable `variable` holds, in its own dtype (float32
    under `mixed_float16`): the one read a layer's call would make, before
    its autocast. Keras 3.15's TensorFlow backend keeps it in
    `Variable._value`, a `tf.Variable` (public: `Variable.value`, which
    autocasts inside a layer's call). Inside `reading`, the value it maps
    `variable` to (Keras 3.15 `keras.src.backend.get_stateless_scope`)."""
    scope = _stateless.get_stateless_scope()
    value = None if scope is None else scope.get_current_value(variable)
    return tf.convert_to_tensor(variable._value) if value is None else value


class _Mapped(keras.StatelessScope):
    """A `keras.StatelessScope` mapping `variables` to `values` as they
    are (its own mapping converts each value to the variable's `dtype`,
    which inside a layer's call is the autocast one, float16), that
    remembers which variables the block assigned, in order, so they can be
    assigned after it. Keras 3.15 `StatelessScope.state_mapping`."""

    def __init__(self, variables, values):
        outer = _stateless.get_stateless_scope()
        super().__init__(collect_losses=True, initialize_variables=False)
        if outer is not None:  # Inside `stateless_call`: its values hold.
            self.state_mapping.update(outer.state_mapping)
        self.state_mapping.update(
            (id(variable), value) for variable, value in zip(variables, values)
        )
        self.assigned = {}

    def add_update(self, update):
        super().add_update(update)
        self.assigned.pop(id(update[0]), None)
        self.assigned[id(update[0])] = update


@contextlib.contextmanager
def reading(layer, variables, values):
    """Within this block, `layer`'s calls read `values` for `variables`
    (autocast as their own reads would be); when it ends, what the block
    assigned to any Keras variable (a batch norm's moving statistics, a
    seed generator's state) is assigned, and the losses `layer` and its
    sublayers added are theirs, as if the block had run without it. With no
    variables, the block runs as it is. Public: `keras.StatelessScope`; its
    losses reach a layer through Keras 3.15's `Layer._loss_ids` and
    `Layer._losses`."""
    if not variables:
        yield
        return
    scope = _Mapped(variables, values)
    with scope:
        yield
    for variable, value in scope.assigned.values():
        variable.assign(value)
    outer = _stateless.get_stateless_scope()
    if outer is not None and outer.collect_losses:
        for loss in scope.losses:
            outer.add_loss(loss)
    elif scope.losses:
        left = {id(x): x for x in scope.losses}
        for sublayer in [layer] + sublayers(layer, recursive=True):
            owned = [x for i, x in left.items() if i in sublayer._loss_ids]
            sublayer._losses.extend(owned)
            for x in owned:
                del left[id(x)]
        layer._losses.extend(left.values())  # Added by layers it calls.
