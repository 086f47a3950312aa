"""The main job, `python -m tf_als.demo`: float16 training three ways
(float32, Keras's loss scaling, tf_als) on two small problems, one line
per run, then a results table per problem, TensorBoard logs and a plot.
`python -m tf_als.demo --help` lists its options. Not part of the
library's API (`tf_als.__all__`)."""

import os

# TensorFlow's INFO and WARNING lines, unless the user chose a level. Under
# `python -m tf_als.demo` the `tf_als` package, and TensorFlow with it, is
# imported before this file runs, and TensorFlow 2.21 reads the variable
# when it logs its first line (at import): the lines it prints at import
# stay (`TF_CPP_MIN_LOG_LEVEL=2 python -m tf_als.demo` hides most of them),
# and the demo holds back the known-harmless ones it logs later
# (`tf_als._src.demo.quiet`).
# Only when run as the program: importing this module leaves the caller's
# environment alone.
if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tf_als._src.demo.demo import main  # noqa: E402

if __name__ == "__main__":
    main()
