"""How an instrumented model is served and saved: `export` and the
SavedModel signature serve the user's model (scaling points exist for
training only); `save` writes a `.keras` file that loads as the
instrumented model where tf_als is imported and as the user's model where
it is not; `compile_from_config` compiles it again on load. `Saving` is a
base of `instrumented.InstrumentedModel`; `user_model` reads the user's
model back out of a saved config for `InstrumentedModel.from_config`.
"""

import keras
import tensorflow as tf

from tf_als._src.model import _keras

# The registered name a saved instrumented model is written with.
REGISTERED_NAME = "tf_als>InstrumentedModel"
# The key of tf_als's part of a saved model's build config.
SAVED = "tf_als"


class Saving:
    """The serving and saving methods of `InstrumentedModel` (which sets
    `_tf_als_original`, `promotions` and `float32_outputs`)."""

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
        original = self._tf_als_original
        if format != "tf_saved_model":
            return original.export(
                filepath, format=format, verbose=verbose,
                input_signature=input_signature, **kwargs,
            )
        if input_signature is None:
            input_signature = _keras.export_input_signature(original)
        archive = keras.export.ExportArchive()
        endpoint = archive.track_and_add_endpoint(
            "serve", original, input_signature, **kwargs
        )
        archive.write_out(filepath, verbose=False)
        if verbose is None or verbose:
            signature = endpoint.get_concrete_function().pretty_printed_signature(
                verbose=False
            )
            _keras.print_message(
                f"Saved artifact at '{filepath}', endpoint 'serve': {signature}"
            )

    @property
    def _default_save_signature(self):
        # `tf.saved_model.save(model, path)` serves the original model's
        # forward pass with the signature `export` gives it (tracing this
        # model's call would save custom gradients).
        original = self._tf_als_original
        specs = _keras.serving_specs(original)

        @tf.function(input_signature=specs)
        def serving_default(*inputs):
            return original(*inputs, training=False)

        return serving_default

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """`keras.Model.save`, written so that `keras.models.load_model`
        rebuilds the instrumented model where tf_als is imported (scales,
        promotions and optimizer state included) and the user's model,
        with its weights, where it is not (compiled with Keras's
        `LossScaleOptimizer` over the same inner optimizer:
        `get_compile_config`). Saved by `keras.saving.save_model(model, ...)`
        instead, the file is the user's model and loads as one.

        Example:

        ```python
        model.fit(x, y)
        model.save("run.keras")
        keras.models.load_model("run.keras")   # instrumented, resumes exactly
        # without tf_als, the same call: the user's model, compiled
        ```
        """
        with _keras.serialized_as(type(self), REGISTERED_NAME):
            return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def get_compile_config(self):
        """Keras's compile config, with the optimizer written as Keras's
        own `LossScaleOptimizer` over the same inner optimizer: a process
        without tf_als then loads the file compiled, with the default
        `keras.models.load_model(path)` (it warns that the optimizer's
        variables do not match and starts it afresh). tf_als's optimizer is
        written in tf_als's part of the build config (`_saved_state`), and
        `compile_from_config` compiles with it where tf_als is imported."""
        config = super().get_compile_config()
        optimizer = getattr(self, "optimizer", None)
        if config and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            stand_in = keras.optimizers.LossScaleOptimizer(
                optimizer.inner_optimizer,
                initial_scale=optimizer.initial_scale,
                dynamic_growth_steps=optimizer.dynamic_growth_steps,
            )
            config = dict(config, optimizer=keras.saving.serialize_keras_object(stand_in))
        return config

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden; ours
        # wraps the optimizer, so compile as Keras would and build the
        # optimizer, whose saved variables (global scale, counters, slots)
        # are loaded next.
        saved = getattr(self, "_tf_als_saved_optimizer", None)
        if saved is not None:  # tf_als's own, not the stand-in.
            config = dict(config, optimizer=saved)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and getattr(self, "optimizer", None) is not None:
            self.optimizer.build(self.trainable_variables)

    def _saved_state(self) -> dict:
        """tf_als's part of the saved build config: what `from_config`
        needs besides the user's model (which `registered_name` the user's
        class loads by, the promotions, `float32_outputs`)."""
        original = self._tf_als_original
        state = {
            "registered_name": keras.saving.get_registered_name(type(original)),
            "promotions": [p.as_dict() for p in self.promotions],
            "float32_outputs": self.float32_outputs,
        }
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            state["optimizer"] = keras.saving.serialize_keras_object(optimizer)
        return state


def user_model(config, custom_objects):
    """(the user's model, tf_als's saved part) of a `.keras` file's model
    whose inner config is `config`."""
    try:
        whole = _keras.deserializing(config)
    except LookupError:
        raise ValueError(
            "InstrumentedModel.from_config() rebuilds a model saved by "
            "tf_als from a whole saved config; load the file with "
            "`keras.models.load_model`, or instrument the model: "
            "`tf_als.instrument(type(model).from_config(config))`."
        ) from None
    build_config = dict(whole.get("build_config") or {})
    saved = build_config.pop(SAVED)
    user = dict(whole, registered_name=saved["registered_name"], build_config=build_config)
    user.pop("compile_config", None)
    model = keras.saving.deserialize_keras_object(user, custom_objects=custom_objects)
    return model, saved
