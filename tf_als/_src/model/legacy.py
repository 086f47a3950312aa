"""`.keras` files written by tf_als 0.2-0.5, read into today's layout.

Those versions saved a wrapper model holding the user's model:

    config:   {"class_name": "InstrumentedModel", "config": {"name": ...,
               "model": <the user's model, serialised whole>,
               "promotions": [...], "float32_outputs": ... (0.4 on)}}
    weights:  layers/<m>/...            the user's model's variables
              layers/scaling_state/vars  tf_als's state
              optimizer/...              the optimizer's

where `<m>` is the name Keras gave the wrapper's one child model (the
snake case of its class's name, e.g. `functional`). Today the user's model
is the saved model itself: its variables sit at the root (`layers/...`,
`vars`) and tf_als's state beside them (`scaling_state/vars`).

`user_model(config)` rebuilds the user's model from such a config and
`read(model, store)`, called by the instrumented model's
`load_own_variables` where Keras starts reading its variables, makes the
store answer today's paths from the old ones. The optimizer's variables
kept their paths, and `state.ScalingState.load_own_variables` reads the
older state layouts.
"""

import keras

from tf_als._src.model import _keras

# The attribute that marks a model rebuilt from an old file.
_MARK = "_tf_als_legacy_layout"
# Where the old files kept tf_als's state, and where today's keep it.
_STATE = "scaling_state"


def is_legacy(config: dict) -> bool:
    """Whether `config`, an `InstrumentedModel`'s inner config, was written
    by tf_als 0.2-0.5."""
    return "promotions" in config and isinstance(config.get("model"), dict)


def user_model(config: dict, custom_objects=None) -> tuple:
    """(the user's model, tf_als's saved part: `promotions`,
    `float32_outputs`) of an old file's `config`. The user's model is
    deserialised as it was saved, without the compile config of its own
    that 0.2-0.5 wrote (the wrapper's optimizer compiles the instrumented
    model)."""
    user = dict(config["model"])
    user.pop("compile_config", None)
    model = keras.saving.deserialize_keras_object(user, custom_objects=custom_objects)
    saved = {
        "promotions": list(config["promotions"]),
        "float32_outputs": bool(config.get("float32_outputs", False)),
    }
    return model, saved


def mark(model) -> None:
    """Marks `model` as rebuilt from an old file: its variables are read
    from the old layout (`read`)."""
    _keras.set_untracked(model, _MARK, True)


def read(model, store):
    """`store`, the weights store Keras reads `model`'s own variables from,
    answering today's paths from an old file's layout if `model` was
    rebuilt from one (`mark`); else `store` as it is.

    Raises:
        ValueError: the file does not hold one model's variables under
            `layers/`, beside tf_als's state, as 0.2-0.5 wrote them; or
            the weights are not read from a `.keras` file's store.
    """
    if not getattr(model, _MARK, False):
        return store
    base = _keras.store_path(store)
    children = _keras.store_children(store, _join(base, "layers"))
    models = [name for name in children if name != _STATE]
    if len(models) != 1 or _STATE not in children:
        raise ValueError(
            f"Model {model.name!r} was rebuilt from a file of tf_als 0.2-0.5, "
            "whose weights hold the user's model and its scaling state "
            f"under 'layers/'; this file holds {sorted(children)} there."
        )
    old = _join(base, "layers", models[0])
    _keras.translate_store_paths(store, lambda path: _old_path(path, base, old))
    return store


def _old_path(path: str, base: str, old: str) -> str:
    """The old file's path of today's `path`: relative to `base` (where
    the instrumented model's variables start), the scaling state moved
    under `layers/`, everything of the user's model under `old`, the
    optimizer where it was."""
    if base and not (path == base or path.startswith(base + "/")):
        return path
    relative = path[len(base):].lstrip("/")
    head = relative.split("/", 1)[0]
    if head == "optimizer":
        return path
    if head == _STATE:
        return _join(base, "layers", relative)
    return _join(old, relative)


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)
