"""Instrumented models with their scaling points set aside, for eager
diagnostics.

The first-batch check re-runs a training step's loss eagerly on the plain
layers. A loss written for a custom training step calls the instrumented
models itself (a GAN's generator loss runs the critic on the generator's
output); within `forward_passes()` every instrumented model's call runs
the model given to `tf_als.instrument` instead: the same layers and
weights, and no scaling point that would multiply the gradients the check
measures.

Example:

```python
with plain.forward_passes():
    loss = gan.generator_loss(z)  # gan.generator, gan.critic: instrumented
```
"""

import contextlib
import contextvars

_PLAIN = contextvars.ContextVar("tf_als_plain_forward_passes", default=False)


@contextlib.contextmanager
def forward_passes():
    """Within this block, instrumented models run their plain forward pass."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def active() -> bool:
    """Whether a `forward_passes()` block is open."""
    return _PLAIN.get()
