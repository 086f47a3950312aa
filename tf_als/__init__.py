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
from tf_als import datasets
from tf_als import plots
from tf_als import preflight
from tf_als import promote
from tf_als import silent
from tf_als import storm
from tf_als.instrument import InstrumentedModel
from tf_als.instrument import PointInfo
from tf_als.instrument import instrument
from tf_als.instrument import points
from tf_als.instrument import scales
from tf_als.optimizer import AdaptiveLossScaleOptimizer
from tf_als.promote import promoted
from tf_als.report import Diagnosis
from tf_als.report import diagnose
from tf_als.silent import SilentFailureWarning
from tf_als.storm import NonFiniteStormError

# 0.2.0: the scaling points' state is stacked (`tf_als.state.ScalingState`), so
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
    "datasets",
    "diagnose",
    "instrument",
    "plots",
    "points",
    "preflight",
    "promote",
    "promoted",
    "scales",
    "silent",
    "storm",
]
