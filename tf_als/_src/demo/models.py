"""The demo's models: the underflow part's (`build_model`) and the failure
part's house-price regression (`build_price_model`)."""

# The demo trains a few hundred steps: with Keras's default momentum 0.99
# the moving statistics that evaluation uses would still be far from the
# data's (measured: 100% train, 18% test accuracy after 230 steps).
BN_MOMENTUM = 0.9


# Depth of `deep-sigmoid`: at 16 layers its trained gradients fit one
# global scale again (Keras flushes 11% of the first layer's elements, with
# 3% error); at 20, 79% (measured on digits, seed 0).
DEEP_SIGMOID_LAYERS = 20


def build_model(name, input_shape, classes):
    """The underflow part's models.

    - `deep-sigmoid`: 20 sigmoid Dense layers of 64 units, each reading the
      previous layer's output and the input (dense input connections, as
      DenseNet reads all earlier features). Through the input connections it
      trains like a shallow network (about 95% test accuracy on digits in
      float32), while the gradients of its first layers still pass through
      up to 20 sigmoids, each of which at least quarters them: they span
      more than float16's range.
    - `cnn`: a small convolutional network with batch normalisation, whose
      gradients one global scale serves.
    - `sigmoid-mlp`: 16 plain sigmoid Dense layers, the textbook
      vanishing-gradient network (it hardly trains, in float32 too).
    """
    import keras

    layers = keras.layers
    inputs = keras.Input(input_shape)
    if name == "deep-sigmoid":
        flat = layers.Flatten()(inputs)
        x = layers.Dense(64, activation="sigmoid", name="sigmoid_1")(flat)
        for depth in range(2, DEEP_SIGMOID_LAYERS + 1):
            x = layers.Concatenate()([x, flat])
            x = layers.Dense(64, activation="sigmoid", name=f"sigmoid_{depth}")(x)
    elif name == "sigmoid-mlp":
        x = layers.Flatten()(inputs)
        for _ in range(16):
            x = layers.Dense(64, activation="sigmoid")(x)
    else:
        x = inputs
        for filters in (16, 32):
            x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = layers.BatchNormalization(momentum=BN_MOMENTUM)(x)
            x = layers.ReLU()(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization(momentum=BN_MOMENTUM)(x)
        x = layers.ReLU()(x)
        x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name=name.replace("-", "_"))


def build_price_model(features):
    """The failure part's model: two ReLU Dense layers and `price`, a
    Dense(1) output in the global policy's compute dtype (float16 under
    mixed_float16, as Keras builds it unless told otherwise)."""
    import keras

    inputs = keras.Input((features,))
    x = keras.layers.Dense(32, activation="relu", name="hidden_1")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="hidden_2")(x)
    outputs = keras.layers.Dense(1, name="price")(x)
    return keras.Model(inputs, outputs, name="prices")
