"""The TensorBoard overview image drawn without matplotlib: the bitmap
font, the colour levels and the layout (`tf_als._src.monitoring.overview`
and `font`). The image as written by `ScaleHistory` is read back from the
event file in `test_callbacks.py`."""

import itertools
import string

import numpy as np
import pytest

from tf_als._src.monitoring import font
from tf_als._src.monitoring import overview


def test_every_printable_character_has_a_glyph_of_its_own():
    printable = [chr(c) for c in range(32, 127)]
    masks = {c: font.render(c) for c in printable}
    assert all(m.shape == (font.GLYPH_HEIGHT, font.GLYPH_WIDTH) for m in masks.values())
    # Only the space is blank, and no two characters look the same.
    assert [c for c, m in masks.items() if not m.any()] == [" "]
    assert len({m.tobytes() for m in masks.values()}) == len(printable)


def test_render_places_glyphs_side_by_side_and_scales_them():
    text = string.ascii_lowercase + "_/.0123456789"
    mask = font.render(text, scale=3)
    assert mask.shape == (3 * font.GLYPH_HEIGHT, font.text_width(text, 3))
    step = font.GLYPH_WIDTH + font.SPACING
    for index, char in enumerate(text):
        glyph = mask[::3, 3 * index * step : 3 * (index * step + font.GLYPH_WIDTH) : 3]
        np.testing.assert_array_equal(glyph, font.render(char), char)
        blank = mask[:, 3 * (index * step + font.GLYPH_WIDTH) : 3 * (index + 1) * step]
        assert not blank.any(), char
    np.testing.assert_array_equal(font.render("é"), font.render("?"))
    assert font.render("").shape == (font.GLYPH_HEIGHT, 0)


def _distance(a, b):
    return float(np.linalg.norm(np.asarray(a, float) - np.asarray(b, float)))


@pytest.mark.parametrize("count", [1, 2, 4, 16, 31, 40])
def test_each_level_gets_its_own_colour(count):
    colours = [tuple(c) for c in overview.palette(count)]
    assert len(set(colours)) == count
    if count > 1:  # dark purple to yellow, the whole ramp
        assert colours[0] == (68, 1, 84) and colours[-1] == (253, 231, 37)


def test_a_narrow_range_spreads_over_the_whole_ramp():
    """log2 scales 0 to 3: four colours far apart (on a fixed -15..15
    range they were four shades of teal about 12 RGB units apart)."""
    names, steps = ["a", "b", "c", "d"], [0, 10]
    values = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    image = overview.overview_image(names, steps, values)
    box = overview.layout(names, steps, 4)
    top, left = box.heat[:2]
    cells = [
        image[top + r * box.row_height + 1, left + box.column_width // 2]
        for r in range(4)
    ]
    closest = min(_distance(a, b) for a, b in itertools.combinations(cells, 2))
    assert closest > 80, cells


def test_missing_values_are_grey_and_do_not_widen_the_range():
    values = np.array([[1.0, np.nan], [2.0, 2.0]])
    assert overview.colour_levels(values) == (1, 2)
    image = overview.overview_image(["a", "b"], [0, 5], values)
    box = overview.layout(["a", "b"], [0, 5], 2)
    top, left = box.heat[:2]
    cell = image[top + 1, left + box.column_width + 1]
    assert tuple(cell) == overview.MISSING
    assert overview.colour_levels(np.full((2, 2), np.nan)) == (0, 0)


@pytest.mark.parametrize(
    "points, updates, scale, column_width",
    [(1, 1, 2, 32), (4, 21, 2, 15), (40, 200, 2, 2), (41, 200, 1, 2), (300, 1000, 1, 2)],
)
def test_layout_sizes(points, updates, scale, column_width):
    """Upscaled blocks: columns 2 to 32 pixels, rows two font cells taller
    than the text; text at twice the font's size up to 40 points."""
    names = [f"block_{i}/dense" for i in range(points)]
    steps = list(range(0, 10 * updates, 10))
    box = overview.layout(names, steps, levels=5)
    assert (box.scale, box.column_width) == (scale, column_width)
    assert box.row_height == (font.GLYPH_HEIGHT + 2) * scale
    top, left, height, width = box.heat
    assert (height, width) == (points * box.row_height, updates * column_width)
    assert box.labels[3] >= font.text_width(names[-1], scale)
    assert left + width <= box.width and box.legend[0] > top + height
    assert box.legend[0] + box.legend[2] < box.height


def test_long_names_keep_their_head_and_tail():
    name = "transformer_layer_11/self_attention/query_dense"
    short = overview.short_label(name)
    assert len(short) == overview.MAX_LABEL_CHARS
    head, tail = short.split("..")
    assert name.startswith(head) and name.endswith(tail)
    assert overview.short_label("dense_1") == "dense_1"


@pytest.mark.parametrize("count", range(1, 41))
@pytest.mark.parametrize("every", [1, 2, 3, 4, 7])
def test_the_colour_scale_numbers_both_ends_without_crowding(count, every):
    levels = overview._numbered(count, every)
    if count - 1 < every:  # no room for two numbers
        assert levels == [0]
    else:
        assert levels[0] == 0 and levels[-1] == count - 1
    assert all(b - a >= every for a, b in zip(levels, levels[1:]))
