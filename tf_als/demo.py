"""The main job, `python -m tf_als.demo`: one model trained on a real
dataset with float32, Keras's loss scaling and tf_als, then a results
table, TensorBoard logs and a plot. `python -m tf_als.demo --help` lists
its options. Not part of the library's API (`tf_als.__all__`)."""

from tf_als._src.demo.demo import main

if __name__ == "__main__":
    main()
