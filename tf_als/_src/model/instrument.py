"""`instrument(model)`: the same layers, with a scaling point at every call of
a layer with weights, and `scales(model)` to read them."""

import inspect
import warnings
import weakref

import keras
import tensorflow as tf
from absl import logging as absl_logging
from keras import tree

from tf_als._src.model import _keras
from tf_als._src.training import backward
from tf_als._src.scaling import config as config_module
from tf_als._src.model import graph
from tf_als._src.model import hooks
from tf_als._src.training import optimizer as optimizer_module
from tf_als._src.training import owners
from tf_als._src.model import own_steps
from tf_als._src.model import points as points_module
from tf_als._src.model.points import PointInfo
from tf_als._src.training import pass_record
from tf_als._src.failures import promote
from tf_als._src.training import state
from tf_als._src.failures import storm
from tf_als._src.training import unscaled


def instrument(model: keras.Model, float32_outputs: bool = False) -> "InstrumentedModel":
    """Returns a model that shares `model`'s layers and weights and gives
    every call of a layer with weights its own adaptive loss scale.

    The returned model's forward outputs are bitwise equal to `model`'s; only
    the backward pass changes (see `backward`). Train it with a
    `tf_als.AdaptiveLossScaleOptimizer` under the `mixed_float16` policy.

    Args:
        model: a built `keras.Model` (Sequential, Functional or subclassed)
            with at least one float16 layer that owns weights. Nested
            Sequential/Functional models are instrumented layer by layer.
            Composite layers (custom layers, `MultiHeadAttention`, subclassed
            models, KerasHub blocks) are opened: each weighted sublayer they
            call is a scaling point too (see `composite`); a
            subclassed model at the top is one opened point, with every
            weighted layer it calls inside it. Recurrent layers and
            `TimeDistributed` stay one point; a warning names them and
            `tf_als.points(model)` gives the reason.
        float32_outputs: bool, default False. Hand the training code
            float32 outputs: the instrumented model casts each float16
            output to float32 (exactly: every float16 value is a float32
            value), so a loss written by hand sums and squares them in
            float32. Keras's own losses cast their inputs to float32
            already; a custom training loop, a model's own `train_step` or a
            loss such as a soft-Dice summed over a batch of maps may not,
            and overflows float16 (65504) without a non-finite value. The
            served model (`predict`, `export`) keeps its outputs' dtypes.

    Returns:
        An `InstrumentedModel` (a `keras.Model`). If `model` is compiled, it
        comes compiled the same way (loss, loss weights, metrics, weighted
        metrics, `jit_compile`, ...), with `model`'s optimizer wrapped in an
        `AdaptiveLossScaleOptimizer` unless it is one already (from a Keras
        `LossScaleOptimizer`, its inner optimizer, initial scale and growth
        steps are carried over).

    Raises:
        TypeError: `model` is not a `keras.Model`.
        ValueError: `model` is already instrumented, not built, has no
            float16 layer with weights, or uses something tf_als cannot
            scale (the message says what and what to do).

    Example:

    ```python
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((64,))
    x = keras.layers.Dense(128, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, dtype="float32")(x)
    model = tf_als.instrument(keras.Model(inputs, outputs))
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ```
    """
    instrumented = InstrumentedModel(model, float32_outputs=float32_outputs)
    arguments = _keras.compile_arguments(model)
    if arguments is not None and own_steps.overrides(model, "compile"):
        warnings.warn(
            f"Model {model.name!r} was compiled with its class's own "
            "compile(); tf_als.instrument() cannot repeat that call. Compile "
            "the instrumented model with the same arguments.",
            stacklevel=2,
        )
    elif arguments is not None:
        arguments["optimizer"] = _adaptive(model.optimizer)
        instrumented.compile(**arguments)
    return instrumented


def _adaptive(optimizer):
    """`optimizer` as an `AdaptiveLossScaleOptimizer`."""
    if optimizer is None or isinstance(
        optimizer, optimizer_module.AdaptiveLossScaleOptimizer
    ):
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer_module.AdaptiveLossScaleOptimizer(
            optimizer.inner_optimizer,
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
        )
    return optimizer_module.AdaptiveLossScaleOptimizer(optimizer)


def scales(model: keras.Model) -> dict[str, float]:
    """The current per-layer scale of every scaling point of an instrumented
    model, as `{point name: float}` in execution order.

    Point names are the layer's full path: its name, prefixed by the
    names of the nested models around its first call (`"encoder/dense"`),
    with `"/call_<i>"` appended for a layer called more than once (every
    call from that same path: a tied embedding that a task's head calls
    again is `"backbone/token_embedding/call_1"`).

    Raises:
        TypeError: `model` was not returned by `tf_als.instrument`.
    """
    _require_instrumented(model, "tf_als.scales()")
    state = model.scaling_state
    values = keras.ops.convert_to_numpy(state.scales)
    return {name: float(v) for name, v in zip(state.point_names, values)}


def points(model: keras.Model) -> list[PointInfo]:
    """Every scaling point of an instrumented model, in the order of
    `tf_als.scales`, with the composite layers that stayed closed and why.

    Raises:
        TypeError: `model` was not returned by `tf_als.instrument`.

    Example:

    ```python
    for point in tf_als.points(model):
        print(point.name, point.kind, point.reason or "")
    # encoder/attention        composite
    # encoder/attention/query  layer
    # ...
    ```
    """
    _require_instrumented(model, "tf_als.points()")
    return list(model.point_infos)


def _require_instrumented(model, what):
    if not isinstance(model, InstrumentedModel):
        raise TypeError(
            f"{what} needs a model returned by tf_als.instrument(); "
            f"received {type(model).__name__} "
            f"{getattr(model, 'name', model)!r}. Instrument it first: "
            "`model = tf_als.instrument(model)`."
        )


@keras.saving.register_keras_serializable(package="tf_als")
class InstrumentedModel(_keras.CheckpointOnly, keras.Model):
    """A model run with per-layer adaptive loss scales.

    Made by `tf_als.instrument(model)`; see there. It shares `model`'s layers
    (and so its weights), runs the same layer calls in the same order, and
    adds custom-gradient identities that scale gradients on the way back.
    Its scaling points are `point_records`, one `points.Point` each, found
    once when it is made; its state is a `state.ScalingState`
    (`scaling_state`: a row per point, in that order, stacked), saved with
    the model and in checkpoints; `scaling_points` views it one point at a
    time.

    Args:
        model: the built model to instrument.
        **kwargs: `keras.Model` arguments (`name`, ...).
    """

    # The promotions' log serves checkpoints only: a SavedModel keeps the
    # promoted layers' float32 computation in its graph.
    checkpoint_only = ("promotion_log",)

    def __init__(self, model: keras.Model, float32_outputs: bool = False, **kwargs):
        _check_flag("float32_outputs", float32_outputs)
        plan, records = _points_of(model)
        # A name scope may not start with "_" (a class `_Net` names its
        # models "_net").
        kwargs.setdefault("name", f"{model.name.lstrip('_') or 'model'}_instrumented")
        super().__init__(**kwargs)
        # Inputs reach the layers exactly as they reach the original model.
        _keras.pass_inputs_through(self)
        self.model = model
        self.float32_outputs = float32_outputs
        # Whether Keras's own train step is being traced (its losses cast
        # their inputs to float32), and whether the warning about float16
        # outputs reaching other training code was given.
        self._keras_train_step = self._warned_float16_outputs = False
        self.promotions = []  # tf_als.promote.Promotion, in order
        # The same list for tf.train.Checkpoint (which saves variables, not
        # dtype policies); `promote.sync` reads it after a restore.
        self.promotion_log = promote.PromotionLog()
        _keras.track(self, self.promotion_log, "promotion_log")
        self._plan = plan
        self._point_records = records
        self.scaling_state = state.ScalingState(
            [p.name for p in records], name="scaling_state"
        )
        _hook(self, records)
        _warn_closed(self)
        # The weight gradients its backward passes unscale, for the
        # optimizer that divides them by S (`unscaled`).
        self.unscaled_gradients = unscaled.UnscaledGradients()
        # What its backward passes chose, for the optimizer to write.
        self.pass_record = pass_record.PassRecord()
        # The knobs its points choose with: the optimizer's, once compiled.
        self.scaling_config = config_module.ScalingConfig()
        self._synchronized = _synchronized_points(records)
        # The AdaptiveLossScaleOptimizers that applied its gradients.
        self._trainers = weakref.WeakKeyDictionary()
        owners.register(self)
        # For tf.train.Checkpoint; rows follow the plan, so a rebuilt model
        # maps them back to the same points.
        _keras.track(self, self.scaling_state, "scaling_state")
        if not graph.is_subclassed(model):
            functional = graph.functional_of(model)
            if hasattr(functional, "output_names"):
                self.output_names = list(functional.output_names)
        self.built = True

    @property
    def plan(self):
        """The `graph.Plan` the model runs."""
        return self._plan

    @property
    def point_records(self) -> tuple:
        """A `points.Point` per scaling point, in row order: what the
        views below are read from."""
        return self._point_records

    @property
    def scaling_points(self) -> tuple:
        """A `state.ScalingPoint` per scaling point: its view of
        `scaling_state`, in row order."""
        return tuple(self.scaling_state.point(p.index) for p in self._point_records)

    @property
    def point_infos(self) -> tuple:
        """A `PointInfo` per scaling point (`Point.info`), in row order."""
        return tuple(p.info() for p in self._point_records)

    @property
    def inner_points(self) -> tuple:
        """`(index, points.Point)` of each point that is not a call of the
        plan (inside another point, or a subclassed model's root)."""
        return tuple(
            (p.index, p) for p in self._point_records if p.kind != points_module.CALL
        )

    @property
    def point_layers(self) -> tuple:
        """The layer each scaling point calls, in row order."""
        return tuple(p.layer for p in self._point_records)

    def trained_by(self) -> list:
        """The live `AdaptiveLossScaleOptimizer`s that applied this model's
        gradients, in the order they first did."""
        return list(self._trainers.keys())

    def note_trainer(self, optimizer) -> None:
        """Records that `optimizer` applies this model's gradients (its
        `apply` calls this)."""
        self._trainers[optimizer] = True

    # -- the original model's own training code and attributes ----------

    def train_step(self, data):
        own = own_steps.method(self.model, "train_step", self, InstrumentedModel)
        if own is not None:
            return own(data)
        self._keras_train_step = True
        try:
            return super().train_step(data)
        finally:
            self._keras_train_step = False

    def test_step(self, data):
        own = own_steps.method(self.model, "test_step", self, InstrumentedModel)
        return own(data) if own is not None else super().test_step(data)

    def predict_step(self, data):
        own = own_steps.method(self.model, "predict_step", self, InstrumentedModel)
        return own(data) if own is not None else super().predict_step(data)

    def compute_loss(self, *args, **kwargs):
        own = own_steps.method(self.model, "compute_loss", self, InstrumentedModel)
        if own is not None:
            return own(*args, **kwargs)
        return super().compute_loss(*args, **kwargs)

    def compute_metrics(self, *args, **kwargs):
        own = own_steps.method(self.model, "compute_metrics", self, InstrumentedModel)
        if own is not None:
            return own(*args, **kwargs)
        return super().compute_metrics(*args, **kwargs)

    @property
    def metrics(self):
        model = self.__dict__.get("model")
        if model is not None:
            found, value = own_steps.prop(model, "metrics", self, InstrumentedModel)
            if found:
                return value
        return super().metrics

    def __getattr__(self, name):
        # Only for names the instrumented model does not have: the
        # original's public attributes (`self.encoder`) and its class's
        # methods (bound to this model, so `self(x)` inside them is
        # scaled). Private names are Keras's bookkeeping, which each model
        # keeps for itself.
        model = self.__dict__.get("model")
        if model is None or name.startswith("_"):
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            )
        try:
            return own_steps.attribute(model, name, self, InstrumentedModel)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object (instrumenting "
                f"{model.name!r}) has no attribute {name!r}"
            ) from None

    def call(self, inputs, training=None, mask=None):
        back = backward.Backward(
            self._plan,
            self.scaling_state,
            self.unscaled_gradients,
            self._point_records,
            config=self.scaling_config,
            record=self.pass_record,
            synchronized=self._synchronized,
        )
        if graph.is_subclassed(self.model):
            # The model is point 0, opened: Keras's own `__call__` runs it
            # (casts, masks carried by the inputs, `training`), and its
            # weighted sublayers are the points inside.
            kwargs = {} if training is None else {"training": training}
            outputs = back.wrap_inner_call(0, self.model, (inputs,), kwargs)
        else:
            outputs = _run(self._plan, back, inputs, training, mask)
        if training:
            back.measure_forward()
        return self._for_the_loss(outputs, training)

    def _for_the_loss(self, outputs, training):
        """`outputs`, cast to float32 when `float32_outputs`; else, in
        training code other than Keras's own train step, a warning (once)
        when one of them is float16."""
        if self.float32_outputs:
            return tree.map_structure(_to_float32, outputs)
        if training and not self._keras_train_step and not self._warned_float16_outputs:
            names = _float16_outputs(self.model, outputs)
            if names:
                self._warned_float16_outputs = True
                warnings.warn(
                    f"Model {self.model.name!r} hands its training code float16 "
                    f"outputs ({', '.join(names)}). A loss written by hand that "
                    "sums or squares them over a batch can overflow float16 "
                    "(65504) and read a constant with every gradient 0, "
                    "without a non-finite value to skip. Compute the loss "
                    "on `tf.cast(y_pred, 'float32')`, give the output layer "
                    "dtype='float32', or pass `float32_outputs=True` to "
                    "tf_als.instrument (the cast is exact).",
                    stacklevel=3,
                )
        return outputs

    def compile(self, *args, **kwargs):
        own = own_steps.method(self.model, "compile", self, InstrumentedModel)
        if own is not None:
            # The model's own compile (a GAN's takes two optimizers); its
            # super().compile() is Keras's.
            result = own(*args, **kwargs)
            self._meet(getattr(self, "optimizer", None))
            return result
        return self._compile(*args, **kwargs)

    def _meet(self, optimizer):
        """Takes `optimizer`'s knobs, if it is an
        `AdaptiveLossScaleOptimizer`, for the backward passes traced from
        now on."""
        if isinstance(optimizer, optimizer_module.AdaptiveLossScaleOptimizer):
            self.scaling_config = optimizer.scaling_config

    def _compile(self, optimizer="rmsprop", *args, **kwargs):
        if optimizer is not None and not isinstance(
            optimizer, optimizer_module.AdaptiveLossScaleOptimizer
        ):
            raise TypeError(
                f"Instrumented model {self.name!r} must be compiled with a "
                "tf_als.AdaptiveLossScaleOptimizer (it drives the per-layer "
                f"scales); received {optimizer!r}. Wrap your optimizer: "
                "`optimizer=tf_als.AdaptiveLossScaleOptimizer("
                "keras.optimizers.Adam())`."
            )
        super().compile(optimizer, *args, **kwargs)
        self._meet(optimizer)

    def fit(self, *args, **kwargs):
        """`keras.Model.fit`, plus a `tf_als.callbacks.NonFiniteGuard` (unless
        one is given) so that a run whose steps are all skipped stops with a
        `NonFiniteStormError` (see `max_consecutive_skips`)."""
        promote.sync(self)  # Promotions restored from a checkpoint.
        bound = _FIT_SIGNATURE.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments["self"]
        batches = _training_batches(
            arguments.get("x"),
            arguments.get("y"),
            arguments.get("sample_weight"),
            arguments.get("batch_size"),
        )
        arguments["callbacks"] = _with_guard(arguments.get("callbacks"), batches)
        spec = _batch_spec(
            arguments.get("x"), arguments.get("y"), arguments.get("sample_weight")
        )
        if spec is not None and getattr(self, "optimizer", None) is not None:
            # One trace of the train step instead of two.
            _keras.build_state_before_tracing(self, spec)
        self._preflight(batches)
        return super().fit(**arguments)

    def _preflight(self, batches):
        """Before the first step of Keras's own train step: promotes the
        layers whose float16 arithmetic fails on the first batch and
        chooses a global scale it can apply with
        (`AdaptiveLossScaleOptimizer.preflight`)."""
        optimizer = getattr(self, "optimizer", None)
        if (
            batches is None
            or not isinstance(optimizer, optimizer_module.AdaptiveLossScaleOptimizer)
            or not optimizer.promote_on_storm
            or getattr(self, "loss", None) is None
            or own_steps.method(self.model, "train_step", self, InstrumentedModel)
            is not None
        ):
            return
        if optimizer.built and int(keras.ops.convert_to_numpy(optimizer.iterations)):
            return
        if not optimizer.built:
            # Under a strategy Keras creates the optimizer's variables in
            # its scope (`fit` does it later). The eager checks run outside
            # it, where a mirrored variable reads as its first copy.
            with self.distribute_strategy.scope():
                optimizer.build(self.trainable_variables)
        optimizer.preflight(self, batches, loss=self._compiled_loss)

    def forget_traces(self) -> None:
        """Drops the traced train, test and predict functions (Keras makes
        them again on their next use): after a promotion, so that they
        compute the promoted layers in float32."""
        self.make_train_function(force=True)
        self.make_test_function(force=True)
        self.make_predict_function(force=True)

    def _compiled_loss(self, y, y_pred, sample_weight=None):
        return self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)

    def summary(
        self,
        line_length=None,
        positions=None,
        print_fn=None,
        expand_nested=False,
        show_trainable=False,
        layer_range=None,
    ):
        """`keras.Model.summary`, and a line after the table saying what
        its `scaling_state` row is: tf_als's state, which the model never
        calls (so Keras shows its output shape as `?`)."""
        super().summary(
            line_length=line_length,
            positions=positions,
            print_fn=print_fn,
            expand_nested=expand_nested,
            show_trainable=show_trainable,
            layer_range=layer_range,
        )
        (print_fn or _print)(_state_note(self.scaling_state))

    def export(
        self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs
    ):
        """`keras.Model.export` of the original model, which shares this
        model's layers and weights and computes the same outputs, bit for
        bit: scaling points exist for training only, so the artifact has
        no custom gradients and loads without tf_als.

        A SavedModel (the default format) is written as `model.export`
        writes it, endpoint `serve`; with `verbose` None or True, one line
        names the endpoint and its signature (Keras adds a line per
        captured variable: dozens for a real model), False prints nothing.
        Other formats are the original model's `export` as it is.

        Example:

        ```python
        model.fit(x, y)
        model.export("serving")                   # after training
        reloaded = tf.saved_model.load("serving")  # tf_als not needed
        reloaded.serve(x)                          # == model.predict(x)
        ```
        """
        if format != "tf_saved_model":
            return self.model.export(
                filepath,
                format=format,
                verbose=verbose,
                input_signature=input_signature,
                **kwargs,
            )
        if input_signature is None:
            input_signature = _keras.export_input_signature(self.model)
        archive = keras.export.ExportArchive()
        endpoint = archive.track_and_add_endpoint(
            "serve", self.model, input_signature, **kwargs
        )
        archive.write_out(filepath, verbose=False)
        if verbose is None or verbose:
            signature = endpoint.get_concrete_function().pretty_printed_signature(
                verbose=False
            )
            _print(f"Saved artifact at '{filepath}', endpoint 'serve': {signature}")

    @property
    def _default_save_signature(self):
        # `tf.saved_model.save(model, path)` serves the original model's
        # forward pass with the signature `export` gives it (Keras finds no
        # inputs on this model, and tracing its own call would save custom
        # gradients).
        model = self.model
        specs = _keras.serving_specs(model)

        @tf.function(input_signature=specs)
        def serving_default(*inputs):
            return model(*inputs, training=False)

        return serving_default

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden; ours
        # only validates, so compile as Keras would and build the
        # optimizer, whose saved variables (global scale, counters, slots)
        # are loaded next.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and getattr(self, "optimizer", None) is not None:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "model": keras.saving.serialize_keras_object(self.model),
            "promotions": [p.as_dict() for p in self.promotions],
            "float32_outputs": self.float32_outputs,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        promotions = config.pop("promotions", [])
        instrumented = cls(model, **config)
        promote.restore(instrumented, promotions)
        return instrumented


def _points_of(model) -> tuple:
    """(the plan, every `points.Point`) of `model`, checked: raises when it
    is instrumented already or holds something tf_als cannot scale."""
    if isinstance(model, InstrumentedModel):
        raise ValueError(
            f"Model {model.name!r} is already instrumented; pass it to "
            "compile()/fit() as it is (instrumenting twice would scale "
            "every gradient twice)."
        )
    if graph.is_subclassed(model):
        _check_subclassed(model)
        plan, records = graph.empty_plan(model), points_module.of_subclassed(model)
    else:
        plan = graph.read(model)
        _check_plan(plan)
        records = points_module.of_plan(plan)
    _check_inner(records)
    own_steps.check(model)
    return plan, records


def _hook(model, records) -> tuple:
    """Hooks the layers of the `"inner"` points among `records`
    (`hooks.install`) for `model` (a subclassed model's root is run by
    `call` itself). The hooks come off (`hooks.uninstall`) when `model`
    is garbage collected, leaving layers that no other instrumented model
    hooks exactly as they were; a model whose scaling points were traced
    into a `tf.function` is never
    collected (TensorFlow's gradient registry keeps every traced
    `tf.custom_gradient`), and its hooks then stay, calling the layer's own
    `call` whenever no scaling point of it runs."""
    token = object()  # The model cannot own its hooks: a finalizer may not
    # hold the model itself.
    layers = tuple(
        p.layer for p in records
        if p.kind == points_module.INNER and hooks.install(p.layer, token)
    )
    weakref.finalize(model, _unhook, layers, token)
    return layers


def _unhook(layers, token):
    for layer in layers:
        hooks.uninstall(layer, token)


def _state_note(state) -> str:
    return (
        f"{state.name} ({type(state).__name__}): not a layer the model calls "
        f"(no output shape), tf_als's state: the loss scales and records of "
        f"{len(state.point_names)} scaling points, {state.count_params():,} "
        "non-trainable values saved with the model. tf_als.scales(model) "
        "reads the scales; tf_als.points(model) lists the points."
    )


def _print(message):
    """Prints `message` as Keras prints its own messages: to stdout, or to
    the log when `keras.config.disable_interactive_logging()` was called."""
    if keras.config.is_interactive_logging_enabled():
        print(message)
    else:
        absl_logging.info(message)


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; received {value!r}.")


def _is_float16(value) -> bool:
    """Whether `value` (a tensor, or a KerasTensor while Keras traces the
    model symbolically) is float16."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and keras.backend.standardize_dtype(dtype) == "float16"


def _to_float32(value):
    return keras.ops.cast(value, "float32") if _is_float16(value) else value


def _float16_outputs(model, outputs) -> list:
    """Names of `model`'s outputs among `outputs` that are float16."""
    flat = tree.flatten(outputs)
    names = list(getattr(model, "output_names", None) or [])
    if len(names) != len(flat):
        names = [f"output {i}" for i in range(len(flat))]
    return [
        repr(name) for name, value in zip(names, flat)
        if _is_float16(value)
    ]


# The arguments of Keras's `Model.fit`, read once (InstrumentedModel.fit
# finds `callbacks` by name, wherever it was given).
_FIT_SIGNATURE = inspect.signature(keras.Model.fit)


def _with_guard(callbacks, batches=None):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    callbacks = list(callbacks or [])
    if not any(isinstance(c, storm.NonFiniteGuard) for c in callbacks):
        callbacks.append(storm.NonFiniteGuard(batches=batches))
    return callbacks


def _batch_spec(x, y, sample_weight):
    """`(x, y, sample_weight)` with the shapes and dtypes of the training
    data (arrays or tensors, or a `tf.data.Dataset`'s `tf.TensorSpec`s), or
    None when they are not known without reading it (generators, Keras
    `PyDataset`s, ragged or sparse elements)."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        if not all(isinstance(s, tf.TensorSpec) for s in tree.flatten(spec)):
            return None
        return spec if isinstance(spec, tuple) else (spec,)
    leaves = [a for a in tree.flatten((x, y, sample_weight)) if a is not None]
    if x is None or not all(
        hasattr(a, "shape") and hasattr(a, "dtype") for a in leaves
    ):
        return None
    return (x, y, sample_weight)


def _training_batches(x, y, sample_weight, batch_size):
    """A callable giving `(x, y, sample_weight)` batches of the training
    data (arrays, tensors or structures of them, or a `tf.data.Dataset`) for
    the guard's eager re-run; None for other inputs (generators, Keras
    `PyDataset`s), which cannot be read twice."""
    if isinstance(x, tf.data.Dataset):
        return lambda: (
            keras.utils.unpack_x_y_sample_weight(e if isinstance(e, tuple) else (e,))
            for e in x
        )
    leaves = tree.flatten(x) if x is not None else []
    if not leaves or not all(hasattr(a, "shape") and len(a.shape) for a in leaves):
        return None
    size = int(leaves[0].shape[0])
    step = int(batch_size or 32)

    def cut(structure, i):
        if structure is None:
            return None
        return tree.map_structure(lambda a: a[i : i + step], structure)

    return lambda: (
        (cut(x, i), cut(y, i), cut(sample_weight, i)) for i in range(0, size, step)
    )


def _synchronized_points(records) -> frozenset:
    """Indices of the points whose layer sums its gradients across
    replicas in its own backward (synchronized BatchNormalization; see
    `backward.Backward`)."""
    return frozenset(
        p.index for p in records
        if getattr(p.layer, "synchronized", False) is True
    )


def _run(plan, back, inputs, training, mask):
    """Runs `plan` on `inputs` with the scaling points, forks and alignments
    of `back` (a `backward.Backward`), exactly as `Functional.call`
    runs the original graph."""
    top = graph.functional_of(plan.model)
    values, edges = {}, {}

    def bind(slot, tensor):
        values[slot] = tensor
        consumers = plan.consumers.get(slot, ())
        if slot in plan.float_slots and len(consumers) > 1:
            for consumer, copy in zip(
                consumers, back.fork(slot, tensor, len(consumers))
            ):
                edges[(slot, consumer)] = copy

    def value(slot, consumer):
        return edges.get((slot, consumer), values[slot])

    for slot, x in zip(plan.input_slots, _model_inputs(top, inputs, mask)):
        bind(slot, back.enter(slot, x))
    for call in plan.calls:
        for slot, y in zip(call.outputs, _run_call(call, value, back, training)):
            bind(slot, y)

    outputs = [
        value(slot, (graph.OUTPUT, k)) for k, slot in enumerate(plan.output_slots)
    ]
    outputs = tree.pack_sequence_as(_keras.outputs_struct(top), outputs)
    if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
        return outputs[0]
    return outputs


def _model_inputs(top, inputs, mask) -> list:
    """The model's flat inputs as `Functional.call` standardises them, with
    the masks given to the call attached."""
    flat_inputs = _keras.standardize_inputs(top, inputs)
    if mask is not None:
        for x, m in zip(flat_inputs, tree.flatten(mask)):
            if m is not None:
                _keras.set_mask(x, m)
    return flat_inputs


def _run_call(call, value, back, training) -> list:
    """The flat outputs of plan call `call`, its inputs read with
    `value(slot, consumer)`: a nested model's entry, a scaling point, or a
    weightless call with its outputs aligned."""
    if call.kind == graph.ENTER:
        flat = [
            value(slot, (graph.ENTER, call.index, position))
            for position, (_, slot) in enumerate(call.inputs)
        ]
        return _keras.enter_functional(call.operation, flat)
    key = (graph.CALL, call.index)
    filled = {kid: value(slot, key) for kid, slot in call.inputs}
    args, kwargs = _keras.fill_in(call.node, filled)
    # As `Functional.call`: the call's own flag wins over what was recorded.
    context_training = call.training if training is None else training
    function = _keras.operation_fn(call.operation, context_training)
    if call.point is not None:
        return back.wrap_call(call, function, args, kwargs)
    return back.align(call, tree.flatten(function(*args, **kwargs)))


def _check_subclassed(model):
    name = model.name
    if not model.built or not model.weights:
        raise ValueError(
            f"Subclassed model {name!r} has no weights yet; "
            "tf_als.instrument() needs a built model. Call it on a batch "
            "first (`model(x)`), or build it (`model.build(input_shape)`)."
        )
    layers = [model] + _keras.sublayers(model, recursive=True)
    if not any(
        layer.weights and getattr(layer, "compute_dtype", None) == "float16"
        for layer in layers
    ):
        raise ValueError(_NO_FLOAT16.format(name=name, policy=model.dtype_policy.name))
    for layer in layers[1:]:
        if isinstance(layer, InstrumentedModel):
            raise ValueError(_INSTRUMENTED_INSIDE.format(name=name, layer=layer.name))


def _check_inner(records):
    """Refuses an inner point whose layer has an activity regularizer (the
    plan's calls are checked by `_check_plan`)."""
    for point in records:
        if point.kind == points_module.CALL:
            continue
        if getattr(point.layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer {point.name!r} has weights and an activity "
                "regularizer; tf_als cannot route the regularizer's gradient "
                "through the layer's scaling point. Move the regularizer "
                "into a `keras.layers.ActivityRegularization` layer after it."
            )


def _warn_closed(model):
    closed = [p for p in model.point_infos if p.kind == "closed"]
    if closed:
        listing = "; ".join(f"{p.name!r} ({p.layer}): {p.reason}" for p in closed)
        warnings.warn(
            f"tf_als.instrument({model.model.name!r}): {len(closed)} "
            f"layer(s) with weighted sublayers stay one scaling point each, "
            f"so one scale serves all of their weights: {listing}. "
            "tf_als.points(model) lists every point.",
            stacklevel=3,
        )


_NO_FLOAT16 = (
    "Model {name!r} computes nothing in float16 (its layers' policy is "
    "{policy!r}); float32 and bfloat16 gradients do not underflow, so loss "
    "scaling is unnecessary. To train in float16, call "
    "`keras.mixed_precision.set_global_policy('mixed_float16')` before "
    "building the model."
)
_INSTRUMENTED_INSIDE = (
    "Model {name!r} contains the instrumented model {layer!r} as a layer; "
    "its gradients would be scaled twice. Build the outer model from the "
    "original model (`{layer}.model`) and instrument the outer one."
)


def _check_plan(plan):
    name = plan.model.name
    if not plan.point_names:
        raise ValueError(
            f"Model {name!r} has no layer with weights, so there is nothing "
            "to scale or train; tf_als.instrument() needs a model with "
            "trainable layers."
        )
    if not any(
        call.kind == graph.LAYER
        and getattr(call.operation, "compute_dtype", None) == "float16"
        for call in plan.calls
    ):
        raise ValueError(
            _NO_FLOAT16.format(name=name, policy=plan.model.dtype_policy.name)
        )
    for call in plan.calls:
        layer = call.operation
        if isinstance(layer, InstrumentedModel):
            raise ValueError(_INSTRUMENTED_INSIDE.format(name=name, layer=layer.name))
        if call.point is not None and getattr(layer, "activity_regularizer", None):
            raise ValueError(
                f"Layer {layer.name!r} has weights and an activity "
                "regularizer; tf_als cannot route the regularizer's gradient "
                "through the layer's scaling point. Move the regularizer "
                "into a `keras.layers.ActivityRegularization` layer after it."
            )
