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
from tf_als._src.monitoring.report import Diagnosis
from tf_als._src.monitoring.report import diagnose
from tf_als._src.training.optimizer import AdaptiveLossScaleOptimizer

# 0.2.0: the scaling points' state is stacked (`ScalingState`), so
# models saved and checkpoints written by 0.1 do not restore their scales.
# 0.3.0: the scales follow the gradient on every step; `update_interval`
# sets the paper rule's interval, `telemetry_interval` the records' (0.2
# `.keras` files and configs load: `ScalingState.load_own_variables`,
# `AdaptiveLossScaleOptimizer`'s `update_interval` deprecation path).
# 0.4.0: failing layers are found on the first batch (`tf_als.preflight`) and
# promoted together, capped by distinct failures; records gain the forward
# headroom columns (0.3 and 0.2 `.keras` files load).
__version__ = "0.4.0"

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
