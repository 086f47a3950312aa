"""A whole model's scaling at one update, summarised: the numbers behind the
epoch logs and TensorBoard's overview cards, which stay few however many
scaling points the model has.

Pure functions of what `ScaleHistory` records (numpy only, no Keras).
"""

import dataclasses

import numpy as np

from tf_als._src.monitoring import font
from tf_als._src.scaling import rule
from tf_als._src.scaling import tallies

WORST_COUNT = 3
"""How many layers the overview names for underflow and for overflow."""

# Viridis sampled at 0, 1/4, 1/2, 3/4 and 1 (dark purple -> blue -> green
# -> yellow), interpolated linearly for the heat map; no matplotlib needed.
_RAMP = np.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
    np.float64,
)


def subnormal_after_scale(histogram, scale: float) -> float:
    """The fraction of a point's incoming gradient elements that stay below
    float16's smallest normal (2**-14) after the point multiplies them by
    `scale`: they reach the layer's backward pass with reduced precision,
    the step before they underflow to zero. Exact zeros (from ReLU,
    padding, pooling, masks) are not counted: nothing was lost there.

    Args:
        histogram: the point's log2 histogram fractions, one per
            exponent in `tallies.HISTOGRAM_EXPONENTS`.
        scale: the point's scale s_n (a power of two).

    >>> h = np.zeros(len(tallies.HISTOGRAM_EXPONENTS))
    >>> h[[0, 10, 30]] = 0.25      # elements at 2**-24, 2**-14, 2**6
    >>> subnormal_after_scale(h, 1.0), subnormal_after_scale(h, 2.0**10)
    (0.25, 0.0)
    """
    shift = int(np.round(np.log2(scale)))
    exponents = np.asarray(tallies.HISTOGRAM_EXPONENTS) + shift
    below = exponents < np.log2(rule.FLOAT16_MIN_NORMAL)
    return float(np.sum(np.asarray(histogram, np.float64)[below]))


def worst(values: dict, count: int = WORST_COUNT) -> list:
    """The `count` entries of `{name: value}` with the largest values
    (ties in name order), largest first, as `(name, value)` pairs; zeros
    are left out.

    >>> worst({"a": 0.1, "b": 0.0, "c": 0.3, "d": 0.2}, 2)
    [('c', 0.3), ('d', 0.2)]
    """
    ranked = sorted(values.items(), key=lambda item: (-item[1], item[0]))
    return [(name, value) for name, value in ranked[:count] if value > 0]


HEAT_WIDTH = 320
"""About how wide the heat map is drawn, in pixels: each update gets
`HEAT_WIDTH // updates` columns, at least 2 and at most 32."""

MAX_LABEL_CHARS = 28
"""Longer point names are shortened in the middle (`head..tail`)."""

LARGE_TEXT_POINTS = 40
"""Up to this many points, text is drawn at twice the font's size."""

TITLE = "log2 per-layer scale"
LEGEND_TITLE = "log2 scale"

BACKGROUND = (255, 255, 255)
INK = (40, 40, 40)
MISSING = (160, 160, 160)
"""The colour of a cell with no value (NaN)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where `overview_image` draws what, in pixels; boxes are
    `(top, left, height, width)`.

    Attributes:
        scale: the text's size, in pixels per font cell.
        row_height: the height of one point's row (the last pixel row of
            each is left blank, to separate rows).
        column_width: the width of one update's column.
        labels: the point names, right-aligned beside their rows.
        heat: the heat map, points by updates.
        legend: the colour scale, one swatch per integer log2 scale
            present, numbered below.
        height, width: the image's size.
    """

    scale: int
    row_height: int
    column_width: int
    labels: tuple
    heat: tuple
    legend: tuple
    height: int
    width: int


def short_label(name: str) -> str:
    """`name`, shortened in the middle to `MAX_LABEL_CHARS` characters.

    >>> short_label("dense")
    'dense'
    >>> short_label("transformer_layer_11/self_attention/query_dense")
    'transfor..ention/query_dense'
    """
    if len(name) <= MAX_LABEL_CHARS:
        return name
    head = (MAX_LABEL_CHARS - 2) // 3  # the tail tells calls apart
    return name[:head] + ".." + name[len(name) - (MAX_LABEL_CHARS - 2 - head):]


def colour_levels(log2_scales):
    """`(low, high)`: the smallest and largest integer log2 scale present
    (values rounded to integers; NaN ignored; `(0, 0)` when all are NaN).

    >>> colour_levels(np.array([[0.0, 3.0], [np.nan, 1.0]]))
    (0, 3)
    """
    values = np.asarray(log2_scales, np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0, 0
    return int(np.round(finite.min())), int(np.round(finite.max()))


def palette(count: int) -> np.ndarray:
    """`count` colours [count, 3] (uint8) spread over the whole ramp, dark
    purple to yellow, so that each integer log2 scale in the data gets a
    colour of its own however narrow the range; one level is the ramp's
    middle.

    >>> palette(2).tolist()
    [[68, 1, 84], [253, 231, 37]]
    """
    if count == 1:
        positions = np.array([0.5])
    else:
        positions = np.linspace(0.0, 1.0, count)
    position = positions * (len(_RAMP) - 1)
    lower = np.floor(position).astype(int).clip(0, len(_RAMP) - 2)
    weight = (position - lower)[:, None]
    colours = _RAMP[lower] * (1 - weight) + _RAMP[lower + 1] * weight
    return colours.round().astype(np.uint8)


def layout(names, steps, levels: int) -> Layout:
    """Where `overview_image` puts things for `names` (one row each),
    `steps` (one column each) and `levels` integer log2 scales in the
    legend.

    >>> box = layout(["a", "b"], steps=[0, 5, 10, 15], levels=3)
    >>> box.heat[2:], box.column_width, box.row_height
    ((40, 128), 32, 20)
    """
    scale = 2 if len(names) <= LARGE_TEXT_POINTS else 1
    margin, gap = 6 * scale, 4 * scale
    text_height = font.GLYPH_HEIGHT * scale
    row_height = text_height + 2 * scale
    updates = len(steps)
    column_width = int(np.clip(HEAT_WIDTH // max(updates, 1), 2, 32))
    label_width = max(
        [font.text_width(short_label(n), scale) for n in names]
        + [font.text_width(LEGEND_TITLE, scale)]
    )
    top = margin + text_height + gap
    left = margin + label_width + gap
    heat = (top, left, row_height * len(names), column_width * updates)
    legend_top = top + heat[2] + 2 * gap + text_height
    swatch = _swatch_width(levels, max(heat[3], HEAT_WIDTH // 2), scale)
    legend = (legend_top, left, row_height + scale + text_height, swatch * levels)
    width = left + max(heat[3], legend[3], font.text_width(TITLE, scale)) + margin
    return Layout(
        scale=scale,
        row_height=row_height,
        column_width=column_width,
        labels=(top, margin, heat[2], label_width),
        heat=heat,
        legend=legend,
        height=legend_top + legend[2] + margin,
        width=max(width, left + font.text_width(axis_text(steps), scale) + margin),
    )


def _swatch_width(levels, room, scale):
    """One legend swatch's width: room for its number when `room` allows,
    never narrower than 2 pixels."""
    wanted = font.text_width("-15", scale) + 3 * scale
    return int(max(2, min(wanted, room // max(levels, 1))))


def axis_text(steps) -> str:
    """The line under the heat map.

    >>> axis_text([0, 100, 200])
    '3 updates, steps 0 to 200'
    """
    if not steps:
        return ""
    return f"{len(steps)} updates, steps {steps[0]} to {steps[-1]}"


def overview_image(names, steps, log2_scales) -> np.ndarray:
    """An RGB image (uint8, [height, width, 3]) of log2 per-layer scales:
    the heat map (rows = points, named on the left; columns = updates,
    each `Layout.column_width` pixels wide), the first and last steps
    below it, and a colour scale with one swatch per integer log2 scale
    from the smallest to the largest present, numbered. Drawn with a
    built-in bitmap font (`font`): no matplotlib needed.

    Args:
        names: the point names, one per row.
        steps: the optimizer step of each column.
        log2_scales: array [points, updates]; NaN draws `MISSING`.

    >>> overview_image(["a"], [0, 5], np.array([[0.0, 2.0]])).shape
    (138, 424, 3)
    """
    values = np.asarray(log2_scales, np.float64).reshape(len(names), len(steps))
    low, high = colour_levels(values)
    colours = palette(high - low + 1)
    box = layout(names, steps, high - low + 1)
    image = np.empty((box.height, box.width, 3), np.uint8)
    image[:] = BACKGROUND
    s = box.scale
    _text(image, TITLE, box.heat[0] - (font.GLYPH_HEIGHT + 4) * s, box.heat[1], s)
    _draw_heat(image, box, values, low, colours)
    for row, name in enumerate(names):
        label = short_label(name)
        right = box.heat[1] - 4 * s - font.text_width(label, s)
        _text(image, label, box.heat[0] + row * box.row_height + s // 2, right, s)
    axis_top = box.heat[0] + box.heat[2] + 2 * s
    _text(image, axis_text(steps), axis_top, box.heat[1], s)
    _draw_legend(image, box, low, colours)
    return image


def _draw_heat(image, box, values, low, colours):
    top, left, _, _ = box.heat
    index = np.nan_to_num(np.round(values) - low).astype(int)
    cells = colours[index.clip(0, len(colours) - 1)]
    cells[np.isnan(values)] = MISSING
    block = np.repeat(np.repeat(cells, box.row_height, axis=0), box.column_width, axis=1)
    # A blank pixel row under each point's row keeps neighbours apart.
    block[box.row_height - 1 :: box.row_height] = BACKGROUND
    image[top : top + block.shape[0], left : left + block.shape[1]] = block


def _draw_legend(image, box, low, colours):
    """Swatches numbered below; every k-th number when they are narrow."""
    top, left, _, width = box.legend
    s, count = box.scale, len(colours)
    swatch = width // count
    title_left = left - 4 * s - font.text_width(LEGEND_TITLE, s)
    _text(image, LEGEND_TITLE, top + s // 2, title_left, s)
    height = box.row_height - 1
    strip = np.repeat(colours[np.newaxis], height, axis=0)
    image[top : top + height, left : left + width] = np.repeat(strip, swatch, axis=1)
    label_width = font.text_width("-15", s) + 2 * s
    every = int(np.ceil(label_width / swatch))
    for level in _numbered(count, every):
        number = str(low + level)
        centre = left + level * swatch + swatch // 2
        left_edge = max(centre - font.text_width(number, s) // 2, 0)
        _text(image, number, top + box.row_height + s, left_edge, s)


def _numbered(count, every):
    """Which of `count` swatches get a number: every `every`-th from the
    first, and the last, in place of the one before it when too close
    (only the first when the last is too close to it).

    >>> _numbered(31, 4)[-3:], _numbered(4, 1), _numbered(3, 4)
    ([20, 24, 30], [0, 1, 2, 3], [0])
    """
    levels = list(range(0, count, every))
    if count - 1 < every or levels[-1] == count - 1:
        return levels
    if count - 1 - levels[-1] < every:
        levels.pop()
    return levels + [count - 1]


def _text(image, text, top, left, scale):
    """Paints `text` in `INK` with its top-left corner at (top, left),
    clipped to the image."""
    mask = font.render(text, scale)
    height = min(mask.shape[0], image.shape[0] - top)
    width = min(mask.shape[1], image.shape[1] - left)
    if height <= 0 or width <= 0:
        return
    region = image[top : top + height, left : left + width]
    region[mask[:height, :width]] = INK
