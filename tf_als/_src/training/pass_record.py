"""What a model's latest backward pass chose and measured at each scaling
point, kept for the optimizer that applies its gradients.

Each scaling point chooses its scale inside its gradient function, from
the gradient it is about to scale (`backward`). Nothing there writes
a variable: a write per point per step would cost a variable update per
point. The point leaves its choice here instead, and the optimizer's
`apply`, which runs after the gradients exist, writes every point's at
once (`update`). Records are kept per graph being traced and per
replica (under `tf.distribute` every replica traces its own pass and its
own `apply` into the same graph, and each must write its own choices: a
replica reading another's tensors would tie their steps together), or, in
eager code, from the latest pass.
"""

import weakref
from typing import NamedTuple

import tensorflow as tf

from tf_als._src.training import unscaled


class PointRecord(NamedTuple):
    """One point's choice in one backward pass.

    Attributes:
        scale: float32 scalar, the scale s_n the point applied.
        scale_out: float32 scalar, T_out, the scale its incoming gradient
            carried.
        amax: float32 scalar, the incoming gradient's amax.
        samples: the `tallies.sample` of each incoming gradient, for
            the telemetry (tallied on telemetry steps only).
        products: the weight gradients the point's own backward pass
            produced and unscaled (not an inner point's), for its gain
            (`update.write_gains`): the very tensors an optimizer receives
            where a variable's whole gradient is one of them.
    """

    scale: tf.Tensor
    scale_out: tf.Tensor
    amax: tf.Tensor
    samples: tuple
    products: tuple = ()


class PassRecord:
    """Point index -> `PointRecord` of the latest backward pass, per graph.

    Example:

    ```python
    record = PassRecord()
    # in a point's gradient function:
    record.put(3, PointRecord(scale, scale_out, amax, samples))
    # in the optimizer's apply, in the same graph (or eagerly, after):
    record.latest()  # {3: PointRecord(...)}
    ```
    """

    def __init__(self):
        # graph -> {replica: {point: PointRecord}}; an entry lives as long
        # as its graph. The same for the forward headroom of the latest
        # forward pass (`put_forward`).
        self._graphs = weakref.WeakKeyDictionary()
        self._eager = {}
        self._forward_graphs = weakref.WeakKeyDictionary()
        self._forward_eager = {}

    def put(self, point: int, record: PointRecord) -> None:
        """Records `point`'s choice (a later pass in the same graph, such as
        the outer gradient after a gradient penalty's, replaces it)."""
        self._current(create=True)[point] = record

    def put_products(self, point: int, products: tuple) -> None:
        """Adds the weight gradients `point` produced to its record (its
        backward pass computes them after it chose)."""
        current = self._current(create=True)
        current[point] = current[point]._replace(products=tuple(products))

    def latest(self) -> dict:
        """The records of the graph being traced (eagerly: the latest
        pass's), by point index; empty when no pass ran there."""
        return dict(self._current(create=False) or {})

    def put_forward(self, rows: dict) -> None:
        """Records the forward headroom of the latest forward pass: point
        index -> its `rule.forward_tallies`, each measured as soon as
        its point ran (nothing read on other than telemetry steps)."""
        current = self._current(create=True, forward=True)
        current.clear()
        current.update(rows)

    def latest_forward(self) -> dict:
        """`put_forward`'s rows of the graph being traced (eagerly: the
        latest), by point index."""
        return dict(self._current(create=False, forward=True) or {})

    def _current(self, create, forward=False):
        graph = unscaled.traced_graph()
        graphs = self._forward_graphs if forward else self._graphs
        eager = self._forward_eager if forward else self._eager
        records = eager if graph is None else graphs.get(graph)
        if records is None:
            if not create:
                return None
            records = graphs.setdefault(graph, {})
        replica = _replica()
        if create:
            return records.setdefault(replica, {})
        return records.get(replica)


def _replica():
    """The replica being traced or run (0 without a strategy): its index,
    when it is known while tracing, else its replica context."""
    context = tf.distribute.get_replica_context()
    if context is None:  # Cross-replica context: not a replica's pass.
        return None
    index = tf.get_static_value(context.replica_id_in_sync_group)
    return context if index is None else int(index)
