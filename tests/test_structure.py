"""The package's shape: no import cycles, and Keras internals touched in one
module only (`tf_als/_keras.py`), so that a Keras upgrade is checked there.

Both read the source; nothing is imported or run.
"""

import ast
import os
import re

import keras

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tf_als")
# The fence: the one module that may touch Keras's and TensorFlow's
# private names (dotted, relative to the package).
FENCE = "_src.model._keras"
# Keras methods tf_als overrides in its subclasses (defining a hook, not
# reading Keras's state): `LossScaleOptimizer` calls them on every step.
OVERRIDES = {"_stateful_handle_finite_grads", "_stateful_handle_non_finite_grads"}


def _modules():
    """{dotted module name relative to `tf_als` (`_src.scaling.rule`; a
    package's `__init__` is the package's name, the top one ""):
    (source, parsed source)} of every module of the package."""
    modules = {}
    for directory, _, files in sorted(os.walk(PACKAGE)):
        relative = os.path.relpath(directory, PACKAGE)
        prefix = "" if relative == "." else relative.replace(os.sep, ".")
        for filename in sorted(files):
            if not filename.endswith(".py"):
                continue
            stem = filename[:-3]
            name = prefix if stem == "__init__" else ".".join(filter(None, [prefix, stem]))
            with open(os.path.join(directory, filename)) as f:
                source = f.read()
            modules[name] = (source, ast.parse(source, filename))
    return modules


def _imports(tree, known=None):
    """The package modules a module imports, anywhere in it (functions
    included: a deferred import still ties the two modules together), as
    dotted names relative to `tf_als`. `from tf_als.a import b` counts as
    `a.b` when that is a module (`known`), else as `a`."""
    known = known if known is not None else _modules()
    found = set()

    def add(dotted):
        found.add(dotted if dotted in known else dotted.rsplit(".", 1)[0] if "." in dotted else dotted)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tf_als" or node.module.startswith("tf_als."):
                base = node.module[len("tf_als."):] if node.module != "tf_als" else ""
                for alias in node.names:
                    add(".".join(filter(None, [base, alias.name])))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tf_als."):
                    add(alias.name[len("tf_als."):])
    return found


def _cycle(graph):
    """One import cycle of `graph` as a list of modules, or None."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    """Guards the next test: a cycle through three modules is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {
        name: {m for m in _imports(tree, modules) if m in modules and m != name}
        for name, (_, tree) in modules.items()
    }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_keras_src_is_imported_only_in_the_fence():
    offenders = [
        name
        for name, (source, _) in _modules().items()
        if name != FENCE and "keras.src" in source
    ]
    assert offenders == [], f"keras.src outside the fence ({FENCE}): {offenders}"


def _keras_private_names():
    """Names Keras's own source defines as private (methods and attributes
    it sets on `self`)."""
    root = os.path.join(os.path.dirname(keras.__file__), "src")
    pattern = re.compile(r"(?:def |self\.)(_[a-z][a-z0-9_]*)\b(?:\s*\(|\s*=[^=])")
    names = set()
    for directory, _, files in os.walk(root):
        for filename in files:
            if filename.endswith(".py") and not filename.endswith("_test.py"):
                with open(os.path.join(directory, filename)) as f:
                    names.update(pattern.findall(f.read()))
    return names


def _own_definitions(modules):
    """Private names the package defines itself: functions, classes and
    module-level names (attributes set on `self` are not counted: in a
    Keras subclass such a name may be Keras's own)."""
    names = set()
    for _, tree in modules.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
        for node in tree.body:
            if isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(tree):
    """(line, name) of every private attribute a module reads or sets."""
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_private_keras_names_are_used_only_in_the_fence():
    modules = _modules()
    keras_names = _keras_private_names()
    assert "_flatten_layers" in keras_names  # the scan reads Keras's source
    ours = _own_definitions(modules)
    offenders = [
        f"{name}:{line} {attr}"
        for name, (_, tree) in modules.items()
        if name != FENCE
        for line, attr in _private_uses(tree)
        if attr in keras_names and attr not in ours and attr not in OVERRIDES
    ]
    assert offenders == [], "private Keras names outside the fence:\n" + "\n".join(
        offenders
    )


# "Short enough to read at once": about 40 lines of code, docstring,
# comments and blank lines not counted.
LONGEST_FUNCTION = 45


def _code_lines(function, lines):
    body = function.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        start = first.end_lineno + 1  # after the docstring
    else:
        start = first.lineno
    return [
        line
        for line in lines[start - 1 : function.end_lineno]
        if line.strip() and not line.strip().startswith("#")
    ]


def test_code_line_counter_skips_docstrings_and_comments():
    source = 'def f():\n    """Doc.\n\n    More."""\n    # note\n\n    x = 1\n    return x\n'
    function = ast.parse(source).body[0]
    assert _code_lines(function, source.splitlines()) == ["    x = 1", "    return x"]


def test_no_function_is_too_long_to_read_at_once():
    too_long = []
    for name, (source, tree) in _modules().items():
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = len(_code_lines(node, lines))
                if count > LONGEST_FUNCTION:
                    too_long.append(f"{name} {node.name}: {count} lines")
    assert too_long == [], "\n".join(too_long)


# Rooms a newcomer reads at once (issue 40): every function at most 60
# lines and every class at most 300, docstrings, comments and blank lines
# included (the count above leaves them out).
LONGEST_WHOLE_FUNCTION = 60
LONGEST_CLASS = 300


def test_no_function_or_class_outgrows_its_room():
    too_long = []
    for name, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            length = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if length > LONGEST_WHOLE_FUNCTION:
                    too_long.append(f"{name} {node.name}: {length} lines")
            elif isinstance(node, ast.ClassDef) and length > LONGEST_CLASS:
                too_long.append(f"{name} class {node.name}: {length} lines")
    assert too_long == [], "\n".join(too_long)


# Attributes of Keras's internal graph classes (`keras.src.ops.node.Node`
# and its `arguments`) that carry no underscore but are not public API, as
# read from a variable named for a node (`inspect.BoundArguments.arguments`
# is public).
NODE_ATTRIBUTES = ("arguments", "is_input", "keras_tensors")


def test_keras_graph_nodes_are_read_only_in_the_fence():
    found = []
    for name, (source, _) in _modules().items():
        if name == FENCE:
            continue
        for number, line in enumerate(source.splitlines(), 1):
            for attribute in NODE_ATTRIBUTES:
                if re.search(rf"node\w*(?:\.\w+)*\.{attribute}\b", line):
                    found.append(f"{name}.py:{number}: .{attribute}")
    assert not found, found


# The modules a user may import: the package itself, the two namespaces it
# exports and the demo's entry point. Everything else lives in `tf_als._src`.
PUBLIC_MODULES = {"", "callbacks", "plots", "demo"}


def test_everything_but_the_public_modules_is_under_src():
    modules = set(_modules())
    outside = {m for m in modules if not (m == "_src" or m.startswith("_src."))}
    assert outside == PUBLIC_MODULES


def _public_names(module):
    return {
        name for name in vars(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), type(os))
        or name in ("callbacks", "plots")
    }


def test_the_public_surface_is_exactly_all():
    import tf_als
    import tf_als.callbacks
    import tf_als.plots

    # Submodules bound as attributes by the import system count only when
    # `__all__` names them.
    assert set(tf_als.__all__) == _public_names(tf_als) | {"callbacks", "plots"}
    assert len(tf_als.__all__) == len(set(tf_als.__all__))
    for module in (tf_als.callbacks, tf_als.plots):
        assert set(module.__all__) == _public_names(module) - {"callbacks", "plots"}
    # Nothing public is a private module of the package.
    for name in tf_als.__all__:
        value = getattr(tf_als, name)
        assert "_src" not in getattr(value, "__name__", "") or not isinstance(value, type(os)), name


# TensorFlow's private surfaces: the fence alone may reach them.
TENSORFLOW_PRIVATE = ("tensorflow.python", "tf.__internal__", "tf.compat.v1", "tf.compat.v2")


def test_private_tensorflow_names_are_used_only_in_the_fence():
    offenders = [
        f"{name}:{number}: {marker}"
        for name, (source, _) in _modules().items()
        if name != FENCE
        for number, line in enumerate(source.splitlines(), 1)
        for marker in TENSORFLOW_PRIVATE
        if marker in line
    ]
    assert offenders == [], offenders


RULE = "_src.scaling.rule"


def _called_names(tree):
    """Names a module reads as `rule.<name>` or calls by bare name."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "rule":
                names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names


def test_every_rule_function_serves_the_library():
    """The rule that is tested is the rule that runs: every public function
    of the rule module is read by another library module, or by a rule
    function that is (the paper's rule reads `nonzero_quantile`). A
    function only tests call is a second rule. (tests/training/
    test_rule_in_step.py checks that a compiled step goes through them.)"""
    modules = _modules()
    source, tree = modules[RULE]
    public = [
        node for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    ]
    used = set()
    for name, (_, other) in modules.items():
        if name != RULE:
            used |= _called_names(other) & {f.name for f in public}
    # Close over calls inside the rule module itself.
    changed = True
    while changed:
        changed = False
        for function in public:
            if function.name in used:
                inner = _called_names(function) & {f.name for f in public}
                if not inner <= used:
                    used |= inner
                    changed = True
    unused = sorted(f.name for f in public if f.name not in used)
    assert unused == [], f"rule functions no library code reaches: {unused}"
    # The per-step rule is composed where the points choose.
    _, choice = modules["_src.training.choice"]
    assert {"amax_of", "headroom", "scale_within"} <= _called_names(choice)


def test_rule_usage_finder_sees_attribute_reads():
    """Guards the test above: `rule.x(...)` and a bare `y(...)` count."""
    tree = ast.parse("def f(g):\n    return rule.amax_of(g) + helper(g)\n")
    assert {"amax_of", "helper"} <= _called_names(tree)


# Module state: a module may bind constants (numbers, strings, tuples,
# frozensets, frozen instances) and define functions and classes; anything
# it could mutate later (a dict, a list, a registry, a counter, a thread-
# local) or anything it does at import (a call whose result is dropped, a
# patch) is state shared by every model in the process.
MUTABLE_CALLS = {
    "dict", "list", "set", "bytearray", "WeakKeyDictionary", "WeakValueDictionary",
    "WeakSet", "count", "local", "defaultdict", "OrderedDict", "Counter", "deque",
}
ALLOWED_NAMES = {"__all__"}


def _module_state(tree):
    """(line, what) of every module-level binding of a mutable value and
    every module-level statement run for its effect."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant):
            found.append((node.lineno, "a statement run at import"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if names & ALLOWED_NAMES:
                continue
            value = node.value
            if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp,
                                  ast.DictComp, ast.SetComp)):
                found.append((node.lineno, f"{sorted(names)} is a mutable literal"))
            for call in ast.walk(value):
                if isinstance(call, ast.Call):
                    function = call.func
                    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
                    if name in MUTABLE_CALLS:
                        found.append((node.lineno, f"{sorted(names)} = {name}(...)"))
        elif isinstance(node, ast.Global):
            found.append((node.lineno, "global"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append((node.lineno, f"global {', '.join(node.names)}"))
    return found


def test_module_state_finder_finds_what_it_should():
    """Guards the next test on a planted module."""
    source = (
        "import threading\nX = (1, 2)\n_cache = {}\n_local = threading.local()\n"
        "register(thing)\n__all__ = ['a']\n\ndef f():\n    global X\n"
    )
    lines = [line for line, _ in _module_state(ast.parse(source))]
    assert lines == [3, 4, 5, 9]


# The two pieces of module state the package keeps, and why each must be
# process-wide. Any other is a defect.
KEPT_STATE = {
    # Per thread, the scaling point whose call is running: a hooked sublayer
    # finds the backward pass that encloses it (replicas trace in parallel
    # threads), as TensorFlow's own name and control-flow scopes do.
    ("_src.model.hooks", "['_local'] = local(...)"),
    # A weak index of live instrumented models: in a custom loop or a GAN
    # the variables an optimizer applies are its only link to the models it
    # must update, and a model never learns its optimizer (docs/design.md).
    ("_src.training.owners", "['_models'] = WeakKeyDictionary(...)"),
    ("_src.training.owners", "['_order'] = count(...)"),
}


def test_no_module_level_mutable_state():
    found = {
        (name, what)
        for name, (_, tree) in _modules().items()
        for line, what in _module_state(tree)
    }
    assert found - KEPT_STATE == set(), "\n".join(sorted(map(str, found - KEPT_STATE)))
    assert KEPT_STATE <= found, "stale KEPT_STATE entries: " + str(KEPT_STATE - found)


def test_diagnostic_patches_hold_for_their_own_thread_only():
    """`layer_calls` and `float32_random_draws` patch Keras for one block of
    one thread's work: another thread calling a layer meanwhile is not
    observed and draws as Keras does; on exit Keras's own functions are
    back."""
    import threading

    import keras
    from keras.src.backend.tensorflow import random as backend_random

    from tf_als._src.model import _keras

    layer = keras.layers.Dense(2)
    layer.build((1, 3))
    seen = []
    original_call = keras.layers.Layer.__call__
    original_uniform = backend_random.uniform
    with _keras.layer_calls(lambda l, inputs, outputs: seen.append(threading.get_ident())):
        with _keras.float32_random_draws():
            other = threading.Thread(target=lambda: layer(keras.ops.ones((1, 3))))
            other.start()
            other.join()
            assert seen == []  # the other thread's call was not observed
            layer(keras.ops.ones((1, 3)))
            assert seen == [threading.get_ident()]
    assert keras.layers.Layer.__call__ is original_call
    assert backend_random.uniform is original_uniform


# Data flows one way between the subpackages: each imports only those
# before it. Two modules assemble what comes after them and are the named
# exceptions: the instrumented model (it holds the backward pass, the state
# and the guard a `fit` needs) and the optimizer (it hands skipped steps to
# the recovery beside it, which calls back into the model).
LAYERS = ("scaling", "model", "training", "failures", "monitoring", "demo")
ASSEMBLERS = {
    "_src.model.instrumented": {"training", "failures"},
    "_src.training.optimizer": {"failures"},
}


def _subpackage(name):
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "_src" else None


def test_data_flows_one_way_between_subpackages():
    modules = _modules()
    backwards = []
    for name, (_, tree) in modules.items():
        source = _subpackage(name)
        if source is None:
            continue
        for target in _imports(tree, modules):
            sink = _subpackage(target)
            if sink is None or sink == source:
                continue
            if LAYERS.index(sink) > LAYERS.index(source) and sink not in ASSEMBLERS.get(name, ()):
                backwards.append(f"{name} -> {target}")
    assert backwards == [], backwards


def test_scaling_is_pure_tensorflow():
    """`scaling/` holds numbers and the rule: no Keras, no other tf_als."""
    for name, (source, tree) in _modules().items():
        if _subpackage(name) != "scaling":
            continue
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        assert "keras" not in imported, name
        assert {_subpackage(t) for t in _imports(tree)} <= {"scaling", None}, name
