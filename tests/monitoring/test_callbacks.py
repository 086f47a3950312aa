"""`tf_als.callbacks.ScaleHistory`: Python history, Keras logs, TensorBoard
event files (read back with TensorBoard's own reader) and the real
TensorBoard server."""

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import tf_als
from tf_als._src.scaling import rule
from tf_als._src.monitoring import callbacks
from tests import architectures

CASE = architectures.CASES[5]  # shared_layer: a shared layer and 4 points


class SmallLoss(keras.losses.Loss):
    """Cross-entropy times 2**-12: small enough that per-layer scales leave
    1, so the records are not all ones."""

    def call(self, y_true, y_pred):
        return (
            keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True
            )
            * 2.0**-12
        )


def _model(interval=2):
    _, mixed = CASE.build_pair()
    model = tf_als.instrument(mixed)
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.1), telemetry_interval=interval
        ),
        loss=SmallLoss(),
    )
    return model


def _data(batches=5):
    x, y = CASE.data()
    return np.concatenate([x] * batches), np.concatenate([y] * batches), len(x)


def test_history_records_every_update(mixed):
    model = _model(interval=2)
    history = callbacks.ScaleHistory()
    x, y, batch = _data(5)
    model.fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
        callbacks=[history],
    )
    record = history.history
    assert record["step"] == [0, 2, 4]
    assert record["skipped_steps"] == [0, 0, 0]
    assert record["loss_scale"] == [2.0**15] * 3
    names = [p.point_name for p in model.scaling_points]
    assert list(record["points"]) == names
    for name, point in zip(names, model.scaling_points):
        values = record["points"][name]
        assert set(values) == set(callbacks.POINT_QUANTITIES) | {"histogram"}
        assert all(len(v) == 3 for v in values.values())
        state = point.read()
        for quantity in callbacks.POINT_QUANTITIES:
            assert values[quantity][-1] == state[quantity], (name, quantity)
        assert values["histogram"][-1] == [
            float(v) for v in point.read_histogram()
        ]
    assert [v["scale"][-1] for v in record["points"].values()] == list(
        tf_als.scales(model).values()
    )
    assert max(v["scale"][-1] for v in record["points"].values()) > 1.0
    # The forward headroom of each float16 output is measured (and far
    # from float16's maximum here); the float32 head has none (0).
    for name, layer in zip(names, model.point_layers):
        values = record["points"][name]
        if layer.compute_dtype == "float16":
            assert 0.0 < values["forward_amax"][-1] < 65504.0 / 16, name
        else:
            assert values["forward_amax"] == [0.0] * 3, name
        assert values["forward_near_max_fraction"] == [0.0] * 3, name
    assert [layer.compute_dtype for layer in model.point_layers].count("float32") == 1
    json.dumps(record)  # plain Python data


def test_epoch_logs_reach_history_and_csv_logger(mixed, tmp_path):
    model = _model(interval=2)
    path = str(tmp_path / "log.csv")
    x, y, batch = _data(3)
    fit = model.fit(
        x,
        y,
        batch_size=batch,
        epochs=2,
        verbose=0,
        callbacks=[callbacks.ScaleHistory(), keras.callbacks.CSVLogger(path)],
    )
    for key in callbacks.EPOCH_LOG_KEYS:
        assert len(fit.history[key]) == 2, key
    assert fit.history["loss_scale"] == [2.0**15, 2.0**15]
    assert fit.history["skipped_steps"] == [0, 0]
    # The worst share of incoming-gradient elements still subnormal after
    # each point's scale, recomputed here from each point's own histogram.
    shares = []
    for point in model.scaling_points:
        histogram, scale = point.read_histogram(), point.read()["scale"]
        exponents = np.asarray(rule.HISTOGRAM_EXPONENTS) + np.log2(scale)
        shares.append(float(np.sum(histogram[exponents < -14])))
    assert fit.history["worst_subnormal_fraction"][-1] == pytest.approx(max(shares), rel=1e-6)
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["loss_scale"]) for r in rows] == [2.0**15, 2.0**15]


def test_skipped_steps_are_counted(mixed):
    """A batch with an infinite input is skipped: the count says so, the
    global scale halves, and the retried update is recorded at the same
    step."""
    model = _model(interval=2)
    history = callbacks.ScaleHistory()
    x, y, batch = _data(4)
    x = x.copy()
    x[2 * batch] = np.inf  # the third batch, an update step (iterations 2)
    model.fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
        callbacks=[history],
    )
    record = history.history
    assert history.skipped_steps == 1
    assert record["step"] == [0, 2, 2]
    assert record["skipped_steps"] == [0, 1, 1]
    assert record["loss_scale"] == [2.0**15, 2.0**14, 2.0**14]
    assert int(model.optimizer.iterations) == 3


def test_custom_loop(mixed):
    _, base = CASE.build_pair()
    model = tf_als.instrument(base)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.1), telemetry_interval=3
    )
    history = callbacks.ScaleHistory()
    history.set_model(model)
    x, y = CASE.data()
    loss = SmallLoss()
    for _ in range(7):
        with tf.GradientTape() as tape:
            value = optimizer.scale_loss(loss(y, model(x, training=True)))
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(value, variables), variables)
        history.record_step()
    assert history.history["step"] == [0, 3, 6]


def _read_run(path):
    accumulator = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    return accumulator


def test_tensorboard_tags_and_values(mixed, tmp_path):
    log_dir = str(tmp_path / "logs")
    model = _model(interval=2)
    history = callbacks.ScaleHistory(log_dir=log_dir)
    assert not os.path.exists(log_dir)  # writers open lazily
    x, y, batch = _data(5)
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=1,
        verbose=0,
        callbacks=[history, keras.callbacks.TensorBoard(log_dir)],
    )
    names = [p.point_name for p in model.scaling_points]
    assert sorted(os.listdir(log_dir)) == ["tf_als", "train"]
    run = _read_run(os.path.join(log_dir, "tf_als"))
    tags = set(run.Tags()[event_accumulator.TENSORS])
    assert tags == (
        callbacks.scalar_tags(names)
        | callbacks.histogram_tags(names)
        | callbacks.text_tags()
        | callbacks.image_tags()
    )
    # The overview: as many cards for 2 points as for 200.
    overview_tags = {t for t in tags if t.startswith("overview/")}
    assert len(overview_tags) == 4, overview_tags
    steps = history.history["step"]
    image = run.Tensors(callbacks.OVERVIEW_IMAGE_TAG)[-1]
    width, height = (int(v) for v in tf.make_ndarray(image.tensor_proto)[:2])
    assert (height, width) == (4 * len(names), 4 * len(steps))
    worst = tf.make_ndarray(run.Tensors(callbacks.OVERVIEW_TEXT_TAG)[-1].tensor_proto)
    assert worst.item().decode().startswith("**underflow** (subnormal after scale):")
    pressure = run.Tensors("overview/worst_near_max_fraction")
    assert [e.step for e in pressure] == steps
    assert float(tf.make_ndarray(pressure[-1].tensor_proto)) == pytest.approx(
        max(v["near_max_fraction"][-1] for v in history.history["points"].values())
    )
    record = history.history
    for name in names:
        group = callbacks.tag_group(name)
        for quantity in callbacks.POINT_QUANTITIES:
            events = run.Tensors(f"{group}/{quantity}")
            assert [e.step for e in events] == record["step"]
            values = [float(tf.make_ndarray(e.tensor_proto)) for e in events]
            assert values == pytest.approx(
                record["points"][name][quantity], rel=1e-7
            ), (name, quantity)
        histogram = tf.make_ndarray(
            run.Tensors(f"{group}/log2_magnitude")[-1].tensor_proto
        )
        assert histogram.shape == (40, 3)
        np.testing.assert_allclose(
            histogram[:, 2], record["points"][name]["histogram"][-1], rtol=1e-7
        )
    scales = [
        float(tf.make_ndarray(run.Tensors(f"{callbacks.tag_group(n)}/scale")[-1].tensor_proto))
        for n in names
    ]
    assert scales == list(tf_als.scales(model).values())
    text = run.Tensors(callbacks.POINT_NAMES_TAG)[0].tensor_proto
    assert tf.make_ndarray(text).item().decode() == "\n".join(names)
    # Keras's own TensorBoard callback wrote its run next to ours.
    train = _read_run(os.path.join(log_dir, "train"))
    assert "epoch_loss" in train.Tags()[event_accumulator.TENSORS]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


def test_real_tensorboard_server_serves_the_scales(mixed, tmp_path):
    log_dir = str(tmp_path / "logs")
    model = _model(interval=2)
    history = callbacks.ScaleHistory(log_dir=log_dir)
    x, y, batch = _data(5)
    model.fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
        callbacks=[history],
    )
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "tensorboard.main",
            "--logdir", log_dir, "--host", "127.0.0.1", "--port", str(port),
            "--reload_interval", "1", "--load_fast", "false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        tags = {}
        while time.time() < deadline:
            try:
                tags = _get_json(f"{base}/data/plugin/scalars/tags")
                if "tf_als" in tags:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        names = [p.point_name for p in model.scaling_points]
        assert set(tags["tf_als"]) == callbacks.scalar_tags(names)
        name = names[-1]
        tag = f"{callbacks.tag_group(name)}/scale"
        query = urllib.parse.urlencode({"run": "tf_als", "tag": tag})
        series = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")
        assert [row[1] for row in series] == history.history["step"]
        assert [row[2] for row in series] == history.history["points"][name]["scale"]
        images = _get_json(f"{base}/data/plugin/images/tags")
        assert set(images["tf_als"]) == callbacks.image_tags()
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_bad_input():
    with pytest.raises(TypeError, match="log_dir"):
        callbacks.ScaleHistory(log_dir=3)
    with pytest.raises(TypeError, match="histograms"):
        callbacks.ScaleHistory(histograms="yes")
    with pytest.raises(ValueError, match="set_model"):
        callbacks.ScaleHistory().record_step()


def test_needs_an_instrumented_model(mixed):
    _, model = CASE.build_pair()
    with pytest.raises(TypeError, match="tf_als.instrument"):
        callbacks.ScaleHistory().set_model(model)
