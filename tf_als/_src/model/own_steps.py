"""A model's own training code, run on its instrumented copy.

A model class may define its own `train_step`, `test_step`,
`predict_step`, `compute_loss`, `compute_metrics`, `metrics` or `compile`
(keras.io, "Customizing what happens in fit()"), and other methods and
attributes its users call (`model.encoder`, `model.generate(...)`). The instrumented
model runs them with `self` bound to itself, so `self(x)` goes through the
scaling points and `self.optimizer` is the optimizer it was compiled with;
attributes it does not have (`self.encoder`, a metric tracker) are the
original model's, the same objects.

A method that calls `super()` without arguments means its class's parent,
which for the instrumented model is `keras.Model`: the function is run with
that meaning. When its parent is itself a user class that defines the same
method, that parent's version cannot be reached, and `check` says so.
"""

import types
from typing import Callable, Optional

# The methods and properties of `keras.Model` a user's class may override
# for its training logic; the instrumented model runs the user's.
STEP_METHODS = (
    "compile",
    "train_step",
    "test_step",
    "predict_step",
    "compute_loss",
    "compute_metrics",
)
STEP_PROPERTIES = ("metrics",)


def _is_keras(cls) -> bool:
    return cls.__module__.split(".")[0] == "keras" or cls is object


def _definitions(model, name) -> list:
    """`(class, value)` for each user class (not Keras's) in `model`'s MRO
    that defines `name`, nearest first."""
    return [
        (cls, vars(cls)[name])
        for cls in type(model).__mro__
        if not _is_keras(cls) and name in vars(cls)
    ]


def _uses_super(function) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and "__class__" in code.co_freevars


def check(model) -> None:
    """Raises `ValueError` for an own step the instrumented model cannot
    run as written (see the module docstring)."""
    for name in STEP_METHODS + STEP_PROPERTIES:
        found = _definitions(model, name)
        if len(found) < 2:
            continue
        (cls, value), (parent, _) = found[0], found[1]
        function = value.fget if isinstance(value, property) else value
        if _uses_super(function):
            raise ValueError(
                f"{cls.__name__}.{name} calls super(), and its parent class "
                f"{parent.__name__} defines {name} too; tf_als runs "
                f"{cls.__name__}.{name} on the instrumented model, where "
                f"super() can only reach keras.Model's. Call the parent's "
                f"explicitly instead: `{parent.__name__}.{name}(self, ...)`."
            )


def overrides(model, name) -> bool:
    """Whether `model`'s class (not Keras) defines `name`."""
    return bool(_definitions(model, name))


def method(model, name, instrumented, base) -> Optional[Callable]:
    """The user's `name` method of `model`'s class, bound to
    `instrumented`, with a bare `super()` meaning `super(base,
    instrumented)`; None when only Keras defines it."""
    found = _definitions(model, name)
    if not found:
        return None
    function = found[0][1]
    if isinstance(function, (staticmethod, classmethod)):
        return getattr(model, name)
    return types.MethodType(_with_super_of(function, base), instrumented)


def prop(model, name, instrumented, base):
    """`(True, value)` of the user's property `name` read on
    `instrumented`, or `(False, None)` when only Keras defines it."""
    found = _definitions(model, name)
    if not found or not isinstance(found[0][1], property):
        return False, None
    getter = _with_super_of(found[0][1].fget, base)
    return True, getter(instrumented)


def attribute(model, name, instrumented, base):
    """`model`'s attribute `name` as the instrumented model offers it: a
    method of the user's class is bound to `instrumented`; anything else
    (a sublayer, a metric tracker, a constant) is `model`'s own object.

    Raises:
        AttributeError: `model` has no attribute `name`.
    """
    found = _definitions(model, name)
    if found and isinstance(found[0][1], types.FunctionType):
        return types.MethodType(_with_super_of(found[0][1], base), instrumented)
    return getattr(model, name)


def _with_super_of(function, base):
    """`function` with its `__class__` cell (what a bare `super()` uses)
    set to `base`; `function` itself when it does not use `super()`."""
    if not _uses_super(function):
        return function
    code = function.__code__
    cells = [
        types.CellType(base) if free == "__class__" else cell
        for free, cell in zip(code.co_freevars, function.__closure__)
    ]
    copy = types.FunctionType(
        code, function.__globals__, function.__name__,
        function.__defaults__, tuple(cells),
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy
