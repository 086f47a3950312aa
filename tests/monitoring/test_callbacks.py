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
from tf_als._src.scaling import tallies
from tf_als._src.monitoring import callbacks
from tf_als._src.monitoring import font
from tf_als._src.monitoring import overview
from tests import architectures

CASE = architectures.CASES[5]  # shared_layer: a shared layer and 4 points

# What `ScaleHistory` writes, as docs/monitoring.md lists it.
POINT_SCALARS = (
    "scale", "cumulative_scale", "percentile", "amax", "zero_fraction",
    "subnormal_fraction", "near_max_fraction", "forward_amax",
    "forward_near_max_fraction",
)
GLOBAL_SCALARS = (
    "global/loss_scale", "global/skipped_steps",
    "overview/worst_subnormal_fraction", "overview/worst_near_max_fraction",
)


def scalar_tags(names) -> set:
    """`<group>/<quantity>` per point (`/` in names becomes `.`), and the
    global and overview scalars."""
    groups = [name.replace("/", ".") for name in names]
    return set(GLOBAL_SCALARS) | {f"{g}/{q}" for g in groups for q in POINT_SCALARS}


def histogram_tags(names) -> set:
    return {name.replace("/", ".") + "/log2_magnitude" for name in names}


TEXT_TAGS = {"global/point_names", "overview/worst_layers"}
IMAGE_TAGS = {"overview/log2_scale"}


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
    for name, layer in zip(names, [p.layer for p in model.point_records]):
        values = record["points"][name]
        if layer.compute_dtype == "float16":
            assert 0.0 < values["forward_amax"][-1] < 65504.0 / 16, name
        else:
            assert values["forward_amax"] == [0.0] * 3, name
        assert values["forward_near_max_fraction"] == [0.0] * 3, name
    assert [layer.compute_dtype for layer in [p.layer for p in model.point_records]].count("float32") == 1
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
        exponents = np.asarray(tallies.HISTOGRAM_EXPONENTS) + np.log2(scale)
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
    assert set(POINT_SCALARS) == set(callbacks.POINT_QUANTITIES)
    assert tags == scalar_tags(names) | histogram_tags(names) | TEXT_TAGS | IMAGE_TAGS
    # The overview: as many cards for 2 points as for 200.
    overview_tags = {t for t in tags if t.startswith("overview/")}
    assert len(overview_tags) == 4, overview_tags
    steps = history.history["step"]
    assert [e.step for e in run.Tensors(callbacks.OVERVIEW_IMAGE_TAG)] == steps
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
        assert set(tags["tf_als"]) == scalar_tags(names)
        name = names[-1]
        tag = f"{callbacks.tag_group(name)}/scale"
        query = urllib.parse.urlencode({"run": "tf_als", "tag": tag})
        series = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")
        assert [row[1] for row in series] == history.history["step"]
        assert [row[2] for row in series] == history.history["points"][name]["scale"]
        images = _get_json(f"{base}/data/plugin/images/tags")
        assert set(images["tf_als"]) == IMAGE_TAGS
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


def _ink(region):
    """The pixels of `region` painted in the overview's ink, cropped to
    their bounding box."""
    ink = np.all(region == overview.INK, axis=-1)
    rows, columns = np.nonzero(ink)
    assert rows.size, "no text here"
    return ink[rows.min() : rows.max() + 1, columns.min() : columns.max() + 1]


def _rendered(text, scale):
    mask = font.render(text, scale)
    rows, columns = np.nonzero(mask)
    return mask[rows.min() : rows.max() + 1, columns.min() : columns.max() + 1]


def test_overview_image_names_the_layers_and_numbers_its_colours(mixed, tmp_path):
    """Read back from the event file: the heat map's size, one colour per
    integer log2 scale (distinct ones for distinct scales, matching the
    numbered colour scale) and every layer's name beside its row."""
    log_dir = str(tmp_path / "logs")
    model = _model(interval=2)
    history = callbacks.ScaleHistory(log_dir=log_dir)
    x, y, batch = _data(5)
    model.fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
        callbacks=[history],
    )
    run = _read_run(os.path.join(log_dir, "tf_als"))
    width, height, png = tf.make_ndarray(
        run.Tensors(callbacks.OVERVIEW_IMAGE_TAG)[-1].tensor_proto
    )
    pixels = tf.io.decode_png(png).numpy()
    names, steps = list(history.history["points"]), history.history["step"]
    log2 = np.log2([history.history["points"][n]["scale"] for n in names])
    low, high = int(log2.min()), int(log2.max())
    assert high > low  # several colours to tell apart
    box = overview.layout(names, steps, high - low + 1)
    assert pixels.shape == (int(height), int(width), 3) == (box.height, box.width, 3)
    # Blocks a person can see: a row as tall as two lines of the font, a
    # column 2 to 32 pixels wide (32 here: 3 updates).
    assert box.row_height >= 2 * font.GLYPH_HEIGHT and box.column_width == 32
    top, left, rows, columns = box.heat
    assert (rows, columns) == (box.row_height * len(names), 32 * len(steps))
    colours = {}
    for r, c in np.ndindex(*log2.shape):
        cell = pixels[
            top + r * box.row_height : top + (r + 1) * box.row_height - 1,
            left + c * box.column_width : left + (c + 1) * box.column_width,
        ]
        assert (cell == cell[0, 0]).all(), (r, c)  # one colour per cell
        colours.setdefault(log2[r, c], set()).add(tuple(cell[0, 0]))
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({c.pop() for c in map(set, colours.values())}) == len(colours)
    # The colour scale: one swatch per integer from low to high, each the
    # colour of the cells with that log2 scale, its number below it.
    legend_top, legend_left, _, legend_width = box.legend
    swatch = legend_width // (high - low + 1)
    middle = legend_top + box.row_height // 2
    swatches = [
        tuple(pixels[middle, legend_left + k * swatch + swatch // 2])
        for k in range(high - low + 1)
    ]
    assert len(set(swatches)) == len(swatches)
    for value, colour in colours.items():
        assert {swatches[int(value) - low]} == colour, value
    # The lowest level's number, centred under its swatch (next numbers
    # are at least a number's width further right).
    centre, half = legend_left + swatch // 2, font.text_width(str(low), box.scale) // 2
    numbers = pixels[legend_top + box.row_height :, centre - half - 2 : centre + half + 2]
    np.testing.assert_array_equal(_ink(numbers), _rendered(str(low), box.scale))
    # Each layer's name, on its row, between the left margin and the map.
    for r, name in enumerate(names):
        strip = pixels[top + r * box.row_height : top + (r + 1) * box.row_height, :left]
        np.testing.assert_array_equal(
            _ink(strip), _rendered(overview.short_label(name), box.scale), name
        )
