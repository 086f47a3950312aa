"""tf_als: adaptive per-layer loss scaling for float16 training in Keras 3.

Implements *Mixed Precision Training* (Micikevicius et al., 2017) and
*Adaptive Loss Scaling for Mixed Precision Training* (Zhao, Vogel, Ahmed,
2019) for Keras 3 on TensorFlow.

```python
import keras, tf_als
keras.mixed_precision.set_global_policy("mixed_float16")
model = tf_als.instrument(build_model())
model.compile(optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
              loss=..., metrics=[...])
model.fit(data)
tf_als.scales(model)
```
"""

from tf_als import callbacks
from tf_als import plots
from tf_als._src.failures.promote import promoted
from tf_als._src.failures.silent import SilentFailureWarning
from tf_als._src.failures.storm import NonFiniteStormError
from tf_als._src.model.instrument import InstrumentedModel
from tf_als._src.model.instrument import PointInfo
from tf_als._src.model.instrument import instrument
from tf_als._src.model.instrument import points
from tf_als._src.model.instrument import scales
from tf_als._src.monitoring.diagnosis import Diagnosis
from tf_als._src.monitoring.report import diagnose
from tf_als._src.training.optimizer import AdaptiveLossScaleOptimizer

# What changed between versions, and what each can load: CHANGELOG.md.
__version__ = "0.6.0"

__all__ = [
    "AdaptiveLossScaleOptimizer",
    "Diagnosis",
    "InstrumentedModel",
    "NonFiniteStormError",
    "PointInfo",
    "SilentFailureWarning",
    "callbacks",
    "diagnose",
    "instrument",
    "plots",
    "points",
    "promoted",
    "scales",
]
