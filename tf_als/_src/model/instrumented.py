"""The instrumented model: an instance of the user's own class whose
forward pass runs through the scaling points.

`make(model)` builds a class for `type(model)` at instrument time,

    class <the user's class name>(_Forward, type(model), InstrumentedModel)

and a new instance of it that holds `model`'s state (the same layers,
variables and attributes; `_keras.fork`). Python's method resolution then
does the rest: `_Forward.call` comes first, so the forward pass goes
through the scaling points; every method the user's class defines
(`train_step`, KerasHub's `fit` on raw text, `generate`, private helpers,
`super()` chains) comes next and runs as written, with `self` the
instrumented model; `InstrumentedModel` sits just above `keras.Model`, so
a `super().fit(...)` or `super().compile(...)` from the user's class
reaches tf_als's (the guard and first-batch check, the optimizer wrapped)
before Keras's. `isinstance(instrumented, type(model))` holds, and
`layers`, `get_layer`, `weights` and `summary` read as the user's model
reads them: tf_als's own state is not among its layers.

Saved as a `.keras` file, an instrumented model is the user's model (its
class, config and weights) plus tf_als's state: loaded where tf_als is not
imported, it is the user's model, with its weights (Keras finds
Functional, Sequential and KerasHub classes by their module; a class of the
user's own must be registered with Keras as usual); loaded with tf_als
imported, it is instrumented again, with its scales, promotions and
optimizer state (`InstrumentedModel.from_config`).
"""

import inspect
import warnings
import weakref

import keras
from keras import tree

from tf_als._src.model import _keras
from tf_als._src.model import checks
from tf_als._src.model import float16_outputs
from tf_als._src.model import graph
from tf_als._src.model import hooks
from tf_als._src.model import legacy
from tf_als._src.model import plain
from tf_als._src.model import points as points_module
from tf_als._src.model import runner
from tf_als._src.model import saving
from tf_als._src.model import training_data
from tf_als._src.scaling import config as config_module
from tf_als._src.training import backward
from tf_als._src.training import optimizer as optimizer_module
from tf_als._src.training import own_step
from tf_als._src.training import owners
from tf_als._src.training import pass_record
from tf_als._src.training import state
from tf_als._src.training import unscaled
from tf_als._src.failures import backward_search
from tf_als._src.failures import promote
from tf_als._src.failures import storm



def make(model: keras.Model, float32_outputs: bool = False) -> "InstrumentedModel":
    """A new instrumented model sharing `model`'s layers and weights (see
    the module docstring); not compiled."""
    _check_flag("float32_outputs", float32_outputs)
    if isinstance(model, InstrumentedModel):
        raise ValueError(
            f"Model {model.name!r} is already instrumented; pass it to "
            "compile()/fit() as it is (instrumenting twice would scale "
            "every gradient twice)."
        )
    plan, records = checks.points_of(model, InstrumentedModel)
    made = _instrumented_class(type(model), float32_outputs)
    instrumented = _keras.fork(model, made)
    instrumented._set_up(model, plan, records, float32_outputs)
    return instrumented


def _instrumented_class(cls, float32_outputs) -> type:
    """The class of an instrumented `cls` model: named, and saved, as
    `cls` (see the module docstring). It remembers `cls` and how its model
    was instrumented, so that Keras making a model of it anew
    (`keras.models.clone_model`) makes one instrumented the same way
    (`_Forward.__new__`, `InstrumentedModel.from_config`)."""
    made = type(cls.__name__, (_Forward, cls, InstrumentedModel), {
        "_tf_als_base": cls,
        "_tf_als_settings": {"float32_outputs": float32_outputs},
    })
    made.__module__, made.__qualname__ = cls.__module__, cls.__qualname__
    made.__doc__ = cls.__doc__
    # Serialised as the user's class (a KerasHub preset names its task's
    # class), except by `save` (`InstrumentedModel.save`).
    _keras.register_serialized_name(made, keras.saving.get_registered_name(cls))
    return made


def adaptive(optimizer):
    """`optimizer` (an instance, or a name Keras knows) as an
    `AdaptiveLossScaleOptimizer`: itself if it is one, a Keras
    `LossScaleOptimizer`'s inner optimizer, initial scale and growth steps
    carried over, any other wrapped; None stays None."""
    if optimizer is None or isinstance(
        optimizer, optimizer_module.AdaptiveLossScaleOptimizer
    ):
        return optimizer
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer_module.AdaptiveLossScaleOptimizer(
            optimizer.inner_optimizer,
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
        )
    return optimizer_module.AdaptiveLossScaleOptimizer(optimizer)


class _Forward:
    """First in an instrumented class's method order: the forward pass
    through the scaling points, and tf_als's part of the saved build
    config. Everything else is the user's class's, then
    `InstrumentedModel`'s."""

    def __new__(cls, *args, **kwargs):
        """Keras making a model of this class from its constructor's
        arguments: `keras.models.clone_model` of a Functional model calls
        its class with the cloned graph's inputs and outputs. The user's
        class makes the model, instrumented as this class's model was (new
        layers and variables, fresh scaling state). `tf_als.instrument`
        itself never calls the class (`_keras.fork`)."""
        model = cls._tf_als_base(*args, **kwargs)
        return make(model, **cls._tf_als_settings)

    def call(self, *args, **kwargs):
        return InstrumentedModel.scaled_call(self, args, kwargs)

    def get_build_config(self):
        config = dict(super().get_build_config() or {})
        config[saving.SAVED] = self._saved_state()
        return config

    def build_from_config(self, config):
        config = {k: v for k, v in (config or {}).items() if k != saving.SAVED}
        if not self.built:
            super().build_from_config(config)

    def load_own_variables(self, store):
        # A model rebuilt from a file of tf_als 0.2-0.5 reads that file's
        # layout (`legacy`).
        super().load_own_variables(legacy.read(self, store))


@keras.saving.register_keras_serializable(package="tf_als")
class InstrumentedModel(saving.Saving, _keras.CheckpointOnly, keras.Model):
    """A model run with per-layer adaptive loss scales.

    Made by `tf_als.instrument(model)`, never directly: it is an instance
    of `type(model)` too (see `tf_als._src.model.instrumented`). It shares
    `model`'s layers (and so its weights), runs the same layer calls in the
    same order, and adds custom-gradient identities that scale gradients on
    the way back. Its scaling points are `point_records`, one
    `points.Point` each, found once when it is made; its state is a
    `state.ScalingState` (`scaling_state`: a row per point, in that order,
    stacked), saved with the model and in checkpoints; `scaling_points`
    views it one point at a time.
    """

    # The promotions' log serves checkpoints only: a SavedModel keeps the
    # promoted layers' float32 computation in its graph.
    checkpoint_only = ("promotion_log",)

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "An InstrumentedModel is made by `tf_als.instrument(model)`, "
            "which returns an instance of the model's own class; it cannot "
            "be constructed directly."
        )

    def _set_up(self, model, plan, records, float32_outputs):
        """Gives a forked model (`_keras.fork`) tf_als's attributes, none
        of them tracked as the user's layers or weights."""
        own = lambda name, value: _keras.set_untracked(self, name, value)  # noqa: E731
        own("_tf_als_original", model)
        if model.name.startswith("_"):
            # Keras 3.15 cannot open a root name scope named "_..." (a class
            # `_Net` names its models "__net"), so `fit` fails on such a
            # model; the instrumented model is named without the
            # underscores (its layers keep theirs).
            own("name", model.name.lstrip("_") or "model")
        # Inputs reach the layers exactly as they reach the original model.
        _keras.pass_inputs_through(self)
        own("float32_outputs", float32_outputs)
        # Whether Keras's own train step is being traced (its losses cast
        # their inputs to float32), and the float16 outputs other training
        # code received (`float16_outputs`).
        own("_keras_train_step", False)
        own("float16_output_record", float16_outputs.Recorded())
        own("promotions", [])  # tf_als.promote.Promotion, in order
        # The same list for tf.train.Checkpoint (which saves variables, not
        # dtype policies); `promote.sync` reads it after a restore.
        own("promotion_log", promote.PromotionLog())
        _keras.track(self, self.promotion_log, "promotion_log")
        own("_plan", plan)
        own("_point_records", records)
        own("scaling_state", state.ScalingState([p.name for p in records], name="scaling_state"))
        # For tf.train.Checkpoint and `.keras` files; rows follow the plan,
        # so a rebuilt model maps them back to the same points.
        _keras.track(self, self.scaling_state, "scaling_state")
        _hook(self, records)
        checks.warn_closed(model, self.point_infos)
        # The weight gradients its backward passes unscale, for the
        # optimizer that divides them by S (`unscaled`).
        own("unscaled_gradients", unscaled.UnscaledGradients())
        # What its backward passes chose, for the optimizer to write.
        own("pass_record", pass_record.PassRecord())
        # The knobs its points choose with: the optimizer's, once compiled.
        own("scaling_config", config_module.ScalingConfig())
        own("_synchronized", _synchronized_points(records))
        # The AdaptiveLossScaleOptimizers that applied its gradients.
        own("_trainers", weakref.WeakKeyDictionary())
        owners.register(self)

    def uninstrumented(self) -> keras.Model:
        """The model given to `tf_als.instrument`: the same layers and
        weights, without scaling points."""
        return self._tf_als_original

    @property
    def plan(self):
        """The `graph.Plan` the model runs."""
        return self._plan

    @property
    def point_records(self) -> tuple:
        """A `points.Point` per scaling point, in row order."""
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

    def trained_by(self) -> list:
        """The live `AdaptiveLossScaleOptimizer`s that applied this model's
        gradients, in the order they first did."""
        return list(self._trainers.keys())

    def note_trainer(self, optimizer) -> None:
        """Records that `optimizer` applies this model's gradients (its
        `apply` calls this)."""
        self._trainers[optimizer] = True

    # -- the forward pass ----------------------------------------------

    def scaled_call(self, args, kwargs):
        """The forward pass, `call(*args, **kwargs)` as Keras's `__call__`
        hands it over: the plan run through the scaling points, or a
        subclassed model's own `call` as one opened point; within
        `plain.forward_passes()` (an eager check), the model given to
        `tf_als.instrument`. So does an eager call that no tape records (a
        decode loop's: with no gradient to scale, its points would cost
        time and change nothing) and a model with no points (it computes
        nothing in float16)."""
        checking = plain.active()  # tf_als's own check: nothing to note.
        if checking or not self._point_records or _keras.eager_and_unrecorded():
            outputs = self._tf_als_original(*args, **kwargs)
            return self._for_the_loss(outputs, kwargs.get("training"), note=not checking)
        back = backward.Backward(
            self._plan,
            self.scaling_state,
            self.unscaled_gradients,
            self._point_records,
            config=self.scaling_config,
            record=self.pass_record,
            synchronized=self._synchronized,
            training=kwargs.get("training"),
        )
        original = self._tf_als_original
        training = kwargs.get("training")
        if graph.is_subclassed(original):
            # The model is point 0, opened: Keras's own `__call__` runs it
            # (casts, masks carried by the inputs, `training`), and its
            # weighted sublayers are the points inside.
            outputs = back.wrap_inner_call(0, original, args, kwargs)
        else:
            inputs = args[0] if args else kwargs.get("inputs")
            outputs = runner.run(self._plan, back, inputs, training, kwargs.get("mask"))
        if training:
            back.choice.finish()
        return self._for_the_loss(outputs, training)

    def _for_the_loss(self, outputs, training, note=True):
        """`outputs`, cast to float32 when `float32_outputs`; else, handed
        to code other than Keras's own train step, its float16 ones noted
        for the warning about sums of them (`float16_outputs`)."""
        if self.float32_outputs:
            return tree.map_structure(_to_float32, outputs)
        record = self.float16_output_record
        if note and not self._keras_train_step and not record.warned:
            names = _float16_outputs(self, outputs)
            if names:
                halves = [y for y in tree.flatten(outputs) if _is_float16(y)]
                record.note(self, names, halves, training)
        return outputs

    # -- Keras's training methods, under the user's ---------------------

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        """`keras.Model.compile`, with the optimizer (and any optimizer a
        model's own `compile` hands on here) an
        `AdaptiveLossScaleOptimizer`: a plain optimizer is wrapped, a Keras
        `LossScaleOptimizer` converted (`adaptive`); for a model with no
        points, as given, as Keras compiles it under that policy."""
        super().compile(adaptive(optimizer) if self._point_records else optimizer, *args, **kwargs)
        if isinstance(self.optimizer, optimizer_module.AdaptiveLossScaleOptimizer):
            _keras.set_untracked(self, "scaling_config", self.optimizer.scaling_config)

    def train_step(self, data):
        _keras.set_untracked(self, "_keras_train_step", True)
        try:
            return super().train_step(data)
        finally:
            _keras.set_untracked(self, "_keras_train_step", False)

    def fit(self, *args, **kwargs):
        """`keras.Model.fit`, plus a `tf_als.callbacks.NonFiniteGuard` (unless
        one is given) so that a run whose steps are all skipped stops with a
        `NonFiniteStormError` (see `max_consecutive_skips`), and the
        first-batch check (`_preflight`)."""
        promote.sync(self)  # Promotions restored from a checkpoint.
        arguments = _FIT_SIGNATURE.bind(self, *args, **kwargs).arguments
        arguments = {k: v for k, v in arguments.items() if k != "self"}
        data = [arguments.get(k) for k in ("x", "y", "sample_weight")]
        batches = training_data.batches(*data, arguments.get("batch_size"))
        arguments["callbacks"] = _with_guard(arguments.get("callbacks"), batches)
        spec = training_data.batch_spec(*data)
        if spec is not None and getattr(self, "optimizer", None) is not None:
            # One trace of the train step instead of two.
            _keras.build_state_before_tracing(self, spec)
        self._preflight(batches)
        return super().fit(**arguments)

    def _preflight(self, batches):
        """Before the first step: promotes the layers whose float16
        arithmetic fails on the first batch and chooses a global scale it
        can apply with (`AdaptiveLossScaleOptimizer.preflight`), with the
        compiled loss under Keras's own train step, with the loss the
        class's own `train_step` hands `optimizer.scale_loss` otherwise
        (`own_step`)."""
        optimizer = getattr(self, "optimizer", None)
        own = type(self).train_step is not InstrumentedModel.train_step
        if (
            batches is None
            or not self._point_records
            or not isinstance(optimizer, optimizer_module.AdaptiveLossScaleOptimizer)
            or not optimizer.promote_on_storm
            or (getattr(self, "loss", None) is None and not own)
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
        if not own:
            optimizer.preflight(self, batches, loss=self._compiled_loss)
            return
        try:
            optimizer.preflight(
                self, own_step.packed(batches), step_loss=own_step.step_loss(self, optimizer)
            )
        except (own_step.Unchecked, backward_search.NotCalled) as error:
            warnings.warn(
                f"fit ran no first-batch check: {error}. Call "
                "`optimizer.preflight(model, batches, step_loss=...)` once "
                "before fit, with the loss the step differentiates "
                "(docs/training-loops.md).",
                stacklevel=3,
            )

    def forget_traces(self) -> None:
        """Drops the traced train, test and predict functions (Keras makes
        them again on their next use): after a promotion, so that they
        compute the promoted layers in float32."""
        self.make_train_function(force=True)
        self.make_test_function(force=True)
        self.make_predict_function(force=True)

    def _compiled_loss(self, y, y_pred, sample_weight=None):
        return self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The instrumented model a `.keras` file holds: the user's model,
        deserialised as Keras would without tf_als, instrumented, its
        promotions re-applied (Keras then compiles it and loads the
        weights and tf_als's state).

        Files written by tf_als 0.2-0.5, which saved the user's model
        nested in a wrapper, load too (`legacy`).

        Raises:
            ValueError: `config` is not part of a whole saved config (see
                `saving.user_model`).
        """
        base = getattr(cls, "_tf_als_base", None)
        if base is not None:
            # Keras rebuilding a model of an instrumented class from the
            # user's class's config (`keras.models.clone_model` of a model
            # whose class Keras finds by its own name): the user's model,
            # instrumented as that class's model was.
            model = base.from_config(config)
            if not model.built:  # Keras builds it after from_config.
                whole = _keras.deserializing(config)
                build_config = dict(whole.get("build_config") or {})
                build_config.pop(saving.SAVED, None)
                model.build_from_config(build_config)
                # Keras 3.15 builds a subclassed model's variables by a
                # symbolic run, which leaves `built` False until its first
                # call; `instrument` needs the variables, which are there.
                model.built = bool(model.weights)
            return make(model, **cls._tf_als_settings)
        old = legacy.is_legacy(config)
        read = legacy.user_model if old else saving.user_model
        model, saved = read(config, custom_objects)
        instrumented = make(model, float32_outputs=saved["float32_outputs"])
        promote.restore(instrumented, saved["promotions"])
        instrumented._tf_als_saved_optimizer = saved.get("optimizer")
        if old:
            legacy.mark(instrumented)
        return instrumented


def _hook(model, records) -> tuple:
    """Hooks the layers of the `"inner"` points among `records`
    (`hooks.install`) for `model` (a subclassed model's root is run by
    `call` itself). The hooks come off (`hooks.uninstall`) when `model`
    is garbage collected, leaving layers that no other instrumented model
    hooks exactly as they were; a model whose scaling points were traced
    into a `tf.function` is never collected (TensorFlow's gradient
    registry keeps every traced `tf.custom_gradient`), and its hooks then
    stay, calling the layer's own `call` whenever no scaling point of it
    runs."""
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
    return [repr(name) for name, value in zip(names, flat) if _is_float16(value)]


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


def _synchronized_points(records) -> frozenset:
    """Indices of the points whose layer sums its gradients across
    replicas in its own backward (synchronized BatchNormalization; see
    `backward.Backward`)."""
    return frozenset(
        p.index for p in records
        if getattr(p.layer, "synchronized", False) is True
    )
