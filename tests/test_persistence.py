"""Persistence of the whole training state (issue 5, item 2).

Every scaling point variable (`scale`, `record`, `histogram`,
`last_update`), the global loss scale (`optimizer.dynamic_scale`), the
optimizer's `step_counter` and `iterations`, Adam's slots and the weights
must survive

- `model.save("x.keras")` + `keras.models.load_model(path)` (no
  `custom_objects`), compiled model with its optimizer state;
- `tf.train.Checkpoint` + `tf.train.CheckpointManager`, restored into a
  freshly built model and optimizer;
- `keras.callbacks.BackupAndRestore`, a `fit` interrupted in its second
  epoch and resumed by a new `fit` on a freshly built model;

and training must continue exactly as if it had never stopped: the state
after "epoch 1, save, restore, epoch 2" is compared bitwise (tolerance 0,
dtypes included) with one uninterrupted 2-epoch `fit` from the same start.

Determinism: these CPU runs are bitwise reproducible in-process with
TensorFlow's default thread pools (three repeated 2-epoch runs gave
identical bytes for every variable), so no single-threaded subprocess is
needed.

The run is made so that nothing can pass vacuously (asserted in
`first_epoch`): the loss is weighted by 2**-12 and the activations are
sigmoids, so per-layer scales leave 1 at the first update; batch 2 of each
epoch holds an inf, so a step is skipped and the global scale halves from
2**15; epoch 1 ends at the odd iteration 5, so with `telemetry_interval=2` the
first resumed step is *not* an update step and trains with the restored
per-layer scales (a lost scale changes the weights, measured: without the
scaling point state the first kernel differs after epoch 2). The models
that receive a restore are built with other layer names and another seed,
so nothing matches by accident.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als

layers = keras.layers

BATCH = 8
BATCHES_PER_EPOCH = 6
INF_BATCH = 2  # skipped step in every epoch
UPDATE_INTERVAL = 2
INITIAL_SCALE = 2.0**15
# After epoch 1: 5 applied steps (one skipped), 3 finite steps since the skip.
ITERATIONS_AFTER_EPOCH_1 = BATCHES_PER_EPOCH - 1
STEP_COUNTER_AFTER_EPOCH_1 = BATCHES_PER_EPOCH - 1 - INF_BATCH


def build(seed=0, prefix=""):
    """The residual model, instrumented and compiled (mixed_float16).

    `prefix` renames every layer (and so every scaling point), as a model
    built in another process or after other models may be named."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,), name=f"{prefix}inputs")
    x = layers.Dense(32, activation="sigmoid", name=f"{prefix}stem")(inputs)
    y = layers.Dense(32, activation="sigmoid", name=f"{prefix}branch")(x)
    x = layers.Add(name=f"{prefix}residual")([x, y])  # x forks: branch, add
    x = layers.Dense(16, activation="sigmoid", name=f"{prefix}hidden")(x)
    outputs = layers.Dense(4, dtype="float32", name=f"{prefix}logits")(x)
    model = tf_als.instrument(keras.Model(inputs, outputs, name=f"{prefix}net"))
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-3),
            initial_scale=INITIAL_SCALE,
            telemetry_interval=UPDATE_INTERVAL,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # A built-in loss and a float weight: the compile config needs no
        # custom object, and the gradients are small enough for per-layer
        # scales above 1.
        loss_weights=2.0**-12,
    )
    return model


def data():
    """One epoch of batches; batch INF_BATCH has an inf input (skipped)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCHES_PER_EPOCH * BATCH, 16)).astype("float32")
    y = rng.integers(0, 4, size=(BATCHES_PER_EPOCH * BATCH,))
    x[INF_BATCH * BATCH, 0] = np.inf
    return x, y


def fit(model, epochs, **kwargs):
    x, y = data()
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


def model_state(model):
    """Weights and every scaling point variable, keyed by position (layer
    names differ between the compared models)."""
    state = {
        f"weights[{i}] ({w.name})": np.array(w)
        for i, w in enumerate(model.uninstrumented().weights)
    }
    for j, point in enumerate(model.scaling_points):
        for name in ("scale", "record", "histogram", "last_update"):
            state[f"point[{j}].{name}"] = np.array(getattr(point, name))
    return state


def optimizer_state(optimizer):
    """The loss scale state, the step counters and every optimizer variable
    (inner optimizer's slots included)."""
    state = {
        "optimizer.dynamic_scale": np.array(optimizer.dynamic_scale),
        "optimizer.step_counter": np.array(optimizer.step_counter),
        "optimizer.iterations": np.array(optimizer.iterations),
    }
    for i, v in enumerate(optimizer.variables):
        state[f"optimizer.variables[{i}]"] = np.array(v)
    return state


def model_state_of(state):
    """The `model_state` part of a `full_state` dict."""
    return {k: v for k, v in state.items() if not k.startswith("optimizer.")}


def full_state(model):
    return {**model_state(model), **optimizer_state(model.optimizer)}


def assert_identical(actual, expected, what):
    """Bitwise equality (dtype, shape and bytes) of two state dicts."""
    assert list(actual) == list(expected), (
        f"{what}: different variables: "
        f"{sorted(set(actual) ^ set(expected))}"
    )
    different = [
        key
        for key in expected
        if actual[key].dtype != expected[key].dtype
        or actual[key].shape != expected[key].shape
        or actual[key].tobytes() != expected[key].tobytes()
    ]
    assert not different, f"{what}: not bitwise equal: " + "; ".join(
        _first_difference(key, actual[key], expected[key]) for key in different
    )


def _first_difference(key, actual, expected):
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (
            f"{key}: {actual.dtype}{list(actual.shape)} != "
            f"{expected.dtype}{list(expected.shape)}"
        )
    a, e = actual.ravel(), expected.ravel()
    i = next(
        i for i in range(a.size) if a[i : i + 1].tobytes() != e[i : i + 1].tobytes()
    )
    return f"{key}[flat {i}]: {a[i]!r} != {e[i]!r}"


# -- the shared runs --------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """Final state of one uninterrupted 2-epoch fit."""
    policy = keras.mixed_precision.global_policy()
    keras.backend.clear_session(free_memory=False)
    model = build(seed=0)
    fit(model, epochs=2)
    state = full_state(model)
    # The resumed part did update the scales again (at iterations 6 and 8).
    assert all(
        state[f"point[{j}].last_update"] > ITERATIONS_AFTER_EPOCH_1
        for j in range(len(model.scaling_points))
    )
    keras.mixed_precision.set_global_policy(policy)
    return state


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory):
    """Epoch 1 of the same run, then `model.save` and a CheckpointManager
    checkpoint. Returns `(state, model_path, checkpoint_dir)`."""
    policy = keras.mixed_precision.global_policy()
    keras.backend.clear_session(free_memory=False)
    directory = tmp_path_factory.mktemp("first_epoch")
    model = build(seed=0)
    fit(model, epochs=1)
    state = full_state(model)
    _assert_state_is_not_trivial(state, len(model.scaling_points))

    model_path = str(directory / "model.keras")
    model.save(model_path)
    checkpoint_dir = str(directory / "checkpoints")
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer),
        checkpoint_dir,
        max_to_keep=2,
    )
    manager.save()
    keras.mixed_precision.set_global_policy(policy)
    return state, model_path, checkpoint_dir


def _assert_state_is_not_trivial(state, points):
    scales = [float(state[f"point[{j}].scale"]) for j in range(points)]
    assert sum(s > 1.0 for s in scales) >= 2, scales
    for j in range(points):
        assert int(state[f"point[{j}].last_update"]) >= 0  # measured
        assert np.any(state[f"point[{j}].histogram"] != 0)
    assert float(state["optimizer.dynamic_scale"]) == INITIAL_SCALE / 2
    assert int(state["optimizer.step_counter"]) == STEP_COUNTER_AFTER_EPOCH_1
    iterations = int(state["optimizer.iterations"])
    assert iterations == ITERATIONS_AFTER_EPOCH_1
    # The first resumed step is not an update step: it trains with the
    # restored per-layer scales rather than re-measuring them.
    assert iterations % UPDATE_INTERVAL != 0


# -- 1. model.save / keras.models.load_model --------------------------------


def test_load_model_restores_weights_and_every_scaling_point_variable(
    mixed, first_epoch
):
    state, path, _ = first_epoch
    loaded = keras.models.load_model(path)  # no custom_objects
    assert isinstance(loaded, tf_als.InstrumentedModel)
    assert_identical(model_state(loaded), model_state_of(state), "after load")


def test_load_model_resumes_training_exactly(mixed, first_epoch, reference):
    state, path, _ = first_epoch
    loaded = keras.models.load_model(path)  # no custom_objects
    assert isinstance(
        getattr(loaded, "optimizer", None), tf_als.AdaptiveLossScaleOptimizer
    ), "load_model did not compile the model: its optimizer state is lost"
    assert_identical(full_state(loaded), state, "after load")
    fit(loaded, epochs=1)
    assert_identical(full_state(loaded), reference, "resumed vs uninterrupted")


# -- 2. tf.train.Checkpoint + CheckpointManager ----------------------------


def _restore_checkpoint(checkpoint_dir):
    model = build(seed=1, prefix="fresh_")
    # Create the optimizer's variables now, so that the restore is not
    # deferred and `assert_consumed` can check every checkpointed value.
    model.optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    assert manager.latest_checkpoint is not None
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    return model


def test_checkpoint_restores_weights_and_optimizer_state(mixed, first_epoch):
    state, _, checkpoint_dir = first_epoch
    model = _restore_checkpoint(checkpoint_dir)
    weights = lambda s: {k: v for k, v in s.items() if k.startswith("weights")}
    assert_identical(
        weights(model_state(model)), weights(state), "weights after restore"
    )
    assert_identical(
        optimizer_state(model.optimizer),
        {k: v for k, v in state.items() if k.startswith("optimizer.")},
        "optimizer after restore",
    )


def test_checkpoint_resumes_training_exactly(mixed, first_epoch, reference):
    state, _, checkpoint_dir = first_epoch
    model = _restore_checkpoint(checkpoint_dir)
    assert_identical(full_state(model), state, "after restore")
    fit(model, epochs=1)
    assert_identical(full_state(model), reference, "resumed vs uninterrupted")


# -- 3. keras.callbacks.BackupAndRestore -----------------------------------


class _Interrupt(keras.callbacks.Callback):
    """Records the state at the end of epoch 1 (what BackupAndRestore
    backs up), then raises after batch `batch` of epoch 2."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch
        self.epoch = None
        self.backed_up = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.backed_up = full_state(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == self.batch:
            raise RuntimeError("Interrupting!")


class _StateAtStart(keras.callbacks.Callback):
    """The state when `fit` starts (after BackupAndRestore, listed first,
    has restored it)."""

    def on_train_begin(self, logs=None):
        self.state = full_state(self.model)


def test_backup_and_restore_resumes_an_interrupted_fit_exactly(
    mixed, reference, tmp_path
):
    backup_dir = str(tmp_path / "backup")
    model = build(seed=0)
    interrupt = _Interrupt(batch=3)
    with pytest.raises(RuntimeError, match="Interrupting"):
        fit(
            model,
            epochs=2,
            callbacks=[keras.callbacks.BackupAndRestore(backup_dir), interrupt],
        )
    _assert_state_is_not_trivial(interrupt.backed_up, len(model.scaling_points))
    # The interrupted run got past the backup (4 applied steps of epoch 2),
    # so a resume from the wrong state could not match.
    assert int(model.optimizer.iterations) == ITERATIONS_AFTER_EPOCH_1 + 3
    assert os.path.exists(os.path.join(backup_dir, "latest.weights.h5"))

    # A new process: another model object with other names and weights.
    resumed = build(seed=1, prefix="fresh_")
    start = _StateAtStart()
    history = fit(
        resumed,
        epochs=2,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir), start],
    )
    assert history.epoch == [1]  # resumed at epoch 2, not from scratch
    assert_identical(start.state, interrupt.backed_up, "after restore")
    assert_identical(full_state(resumed), reference, "resumed vs uninterrupted")
    assert not os.path.exists(backup_dir)  # finished: backup deleted


def test_saved_model_save_is_quiet_and_checkpoints_keep_promotions(
    mixed, tmp_path, capfd, caplog
):
    """`tf.saved_model.save` on a model with a promotion prints nothing
    about the promotions' log (a SavedModel serves the promoted layer's
    float32 graph and has no use for it; TensorFlow warns about a
    `PythonState` once per pass over the object graph, six times), while a
    `tf.train.Checkpoint` still carries the log to a fresh model."""
    from tf_als._src.failures import promote

    model = build(seed=0)
    record = dict(layer="hidden", reason=promote.FORWARD, step=3)
    promote.restore(model, [record])
    x, _ = data()
    x = x[BATCH * (INF_BATCH + 1):]  # finite rows
    capfd.readouterr()
    with caplog.at_level("WARNING"):
        tf.saved_model.save(model, str(tmp_path / "saved"))
    out, err = capfd.readouterr()
    printed = out + err + caplog.text
    assert "python values" not in printed, printed[-2000:]
    served = tf.saved_model.load(str(tmp_path / "saved"))
    (output,) = served.signatures["serving_default"](tf.constant(x)).values()
    np.testing.assert_array_equal(output.numpy(), model.predict(x, verbose=0))

    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = build(seed=1, prefix="fresh_")
    tf.train.Checkpoint(model=fresh).restore(path).assert_existing_objects_matched()
    assert fresh.promotion_log.records == [record]
