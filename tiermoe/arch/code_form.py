"""Whether a module class computes what a reference class computes, read from their code: the fused paths'
key (norms, routers, attention, whole decoder layers), in place of a list of class names.

transformers writes most families' modules by copying another family's (its "modular" files): Mellum's and Dots1's
attention are Qwen3-MoE's, PhiMoE's and Granite-MoE's are Qwen2-MoE's, most RMSNorms are Llama's, each under its
own class name. Two classes have the same code here when their method's source, parsed, is the same tree once
names that do not change what it computes are dropped (the function's own name, docstrings, annotations), and
every name it reads is the same thing: a function of its module (apply_rotary_pos_emb, rotate_half,
eager_attention_forward) the same code again, read the same way; a method it calls on `self` the same code; an
attribute of its class the same object or an equal constant; their classes' decorators the same calls (but a hub
kernel's name, inert here); anything else (torch, transformers' attention table) the same object or an equal
constant. What the method reaches through its instance (child modules, values its __init__ set) is the
instance's, as it is for the reference: a fused path that computes a child in its own way checks that child's
class itself.

A class transformers' next version changes stops matching, and its modules keep their own forward: never a wrong
result, at worst a slower one.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from types import FunctionType
from typing import Generic, TypeVar

Value = TypeVar("Value")
ClassKey = tuple[str, str]  # (module path, qualified name): tables name classes without importing their files
_CONSTANTS = (bool, int, float, str, bytes, type(None))


def class_key(cls: type) -> ClassKey:
    return cls.__module__, cls.__qualname__


class CodeForms(Generic[Value]):
    """A table of reference classes -> what a fused path does for them; `of(cls)` gives the value of the
    reference `cls` has the same code as (`method` and what it reaches, see the module docstring), or None.
    Answers are kept per class (a class's code does not change while it is loaded)."""

    def __init__(self, table: Mapping[ClassKey, Value], method: str = "forward"):
        self.table, self.method = dict(table), method
        self._found: dict[type, Value | None] = {}
        self._references: dict[ClassKey, tuple[type, str | None] | None] = {}  # imported, with _method_alone

    def of(self, cls: type) -> Value | None:
        if cls not in self._found:
            self._found[cls] = self._find(cls)
        return self._found[cls]

    def _find(self, cls: type) -> Value | None:
        key = class_key(cls)
        if key in self.table:
            return self.table[key]
        alone = _method_alone(cls, self.method)
        if alone is None:
            return None
        for reference_key, value in self.table.items():
            if reference_key not in self._references:
                reference = import_class(*reference_key)
                self._references[reference_key] = reference and (reference, _method_alone(reference, self.method))
            found = self._references[reference_key]
            if found is not None and found[1] == alone and _Comparison().methods(cls, found[0], self.method):
                return value  # (same_code's first check, the method alone, is the line before)
        return None


def same_code(a: type, b: type, method: str = "forward") -> bool:
    """Whether classes `a` and `b` compute `method` the same way (see the module docstring)."""
    if _owner(a, method) is not _owner(b, method) and _method_alone(a, method) != _method_alone(b, method):
        return False  # most classes differ here, before their module files are read
    return _Comparison().methods(a, b, method)


def _method_alone(cls: type, method: str) -> str | None:
    """The method's own tree as compared (its source alone, not its module's), or None where it has none."""
    owner = _owner(cls, method)
    if owner is None:
        return None
    fn = vars(owner)[method]
    fn = getattr(fn, "fget", None) or getattr(fn, "__func__", None) or fn
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        return _normal(ast.parse(source).body[0])
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def import_class(module: str, name: str) -> type | None:
    """The class `name` of `module`, or None where the installed packages have no such class."""
    try:
        found = importlib.import_module(module)
    except ImportError:  # a family the installed transformers does not have
        return None
    for part in name.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


class _Comparison:
    """One comparison: the pairs of functions already compared (or being compared: a recursion assumes they
    match, as the others are compared on the way back) and the parsed module files."""

    def __init__(self):
        self.seen: set[tuple] = set()
        self.trees: dict[str, dict[str, ast.AST] | None] = {}

    def methods(self, a: type, b: type, method: str) -> bool:
        owner_a, owner_b = _owner(a, method), _owner(b, method)
        if owner_a is None or owner_b is None:
            return False
        if owner_a is owner_b and not _overridden(a, owner_a) and not _overridden(b, owner_b):
            return True  # the same function, and nothing it could call on self redefined below it
        node_a, node_b = self._class_node(owner_a), self._class_node(owner_b)
        if node_a is None or node_b is None:
            return False
        if _class_decorators(node_a) != _class_decorators(node_b):
            return False
        fn_a, fn_b = _method_node(node_a, method), _method_node(node_b, method)
        if fn_a is None or fn_b is None:
            return False
        return self._functions(fn_a, fn_b, owner_a.__module__, owner_b.__module__, (a, b))

    def _functions(self, fn_a: ast.AST, fn_b: ast.AST, module_a: str, module_b: str,
                   classes: tuple[type, type] | None = None) -> bool:
        """Two function trees of those modules: methods of `classes` (whose own methods `self.x` resolves to), or
        functions of the modules (classes None)."""
        pair = (id(fn_a), id(fn_b))
        if pair in self.seen:
            return True
        self.seen.add(pair)
        if _normal(fn_a) != _normal(fn_b):
            return False
        for name in _globals_read(fn_a):
            if not self._same_global(name, module_a, module_b):
                return False
        if classes is not None:
            a, b = classes
            for attr in _self_attributes_read(fn_a):
                if _is_code(a, attr) or _is_code(b, attr):
                    if not self.methods(a, b, attr):
                        return False
                elif not _same_value(inspect.getattr_static(a, attr, _MISSING),
                                     inspect.getattr_static(b, attr, _MISSING)):
                    return False  # a class attribute (an instance's own, set in __init__, is found in neither)
        return True

    def _same_global(self, name: str, module_a: str, module_b: str) -> bool:
        defs_a, defs_b = self._module_defs(module_a), self._module_defs(module_b)
        if defs_a is None or defs_b is None:
            return False
        node_a, node_b = defs_a.get(name), defs_b.get(name)
        if isinstance(node_a, ast.FunctionDef) and isinstance(node_b, ast.FunctionDef):
            return self._functions(node_a, node_b, module_a, module_b)
        # the same import (torch, nn, ALL_ATTENTION_FUNCTIONS), a builtin in neither, or an equal constant
        return _same_value(vars(sys.modules[module_a]).get(name, _MISSING),
                           vars(sys.modules[module_b]).get(name, _MISSING))

    def _class_node(self, cls: type) -> ast.ClassDef | None:
        node: ast.AST | None = None
        defs = self._module_defs(cls.__module__)
        for part in cls.__qualname__.split("."):
            node = defs.get(part) if defs is not None else None
            if not isinstance(node, ast.ClassDef):
                return None
            defs = {child.name: child for child in node.body if isinstance(child, (ast.ClassDef, ast.FunctionDef))}
        return node

    def _module_defs(self, module: str) -> dict[str, ast.AST] | None:
        """The module's top-level functions and classes by name (None when its source cannot be read)."""
        if module not in self.trees:
            self.trees[module] = _read_defs(module)
        return self.trees[module]


_MISSING = object()


def _same_value(a, b) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, _CONSTANTS) and a == b)


def _read_defs(module: str) -> dict[str, ast.AST] | None:
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None)
    if path is None or not path.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


# Class decorators that change nothing the class computes here: `use_kernel_forward_from_hub` names a hub kernel
# that replaces the forward only when a model is kernelized (transformers' `use_kernels`), which tiermoe never does.
_INERT_CLASS_DECORATORS = {"use_kernel_forward_from_hub"}


def _class_decorators(node: ast.ClassDef) -> list[str]:
    return [_normal(d) for d in node.decorator_list
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id in _INERT_CLASS_DECORATORS)]


def _is_code(cls: type, attr: str) -> bool:
    """Whether `cls.attr` is code of the class (a method or property), not a value its instances hold."""
    return isinstance(inspect.getattr_static(cls, attr, None), (FunctionType, property, staticmethod, classmethod))


def _overridden(cls: type, owner: type) -> bool:
    """Whether a class of `cls`'s MRO before `owner` defines code of its own (a method or property)."""
    below = cls.__mro__[:cls.__mro__.index(owner)]
    return any(_is_code(c, name) for c in below for name in vars(c))


def _owner(cls: type, method: str) -> type | None:
    """The class of `cls`'s MRO whose body defines `method`."""
    return next((c for c in cls.__mro__ if method in vars(c)), None)


def _method_node(node: ast.ClassDef, method: str) -> ast.FunctionDef | None:
    return next((c for c in node.body if isinstance(c, ast.FunctionDef) and c.name == method), None)


def _normal(node) -> str:
    """The tree as compared: a function's name, its docstring, every annotation and every position left out."""
    if isinstance(node, list):
        return "[" + ",".join(_normal(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name, value in ast.iter_fields(node):
        if name in _NOT_COMPARED or (name == "name" and isinstance(node, ast.FunctionDef)):
            continue
        if name == "body" and isinstance(node, ast.FunctionDef) and _is_docstring(value[0]):
            value = value[1:]
        fields.append(_normal(value))
    return f"{type(node).__name__}({','.join(fields)})"


_NOT_COMPARED = {"returns", "annotation", "type_comment"}


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def _globals_read(fn: ast.FunctionDef) -> list[str]:
    """Names the function reads that it does not bind itself (its module's, or builtins), in order, once each;
    the decorators' and defaults' included, annotations not (they compute nothing)."""
    bound = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg,
                             fn.args.kwarg] if a is not None}
    annotations = {id(n) for a in ast.walk(fn) for n in _annotation_nodes(a)}
    loads = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and id(node) not in annotations:
            if isinstance(node.ctx, ast.Load):
                loads.append(node.id)
            else:
                bound.add(node.id)
        elif isinstance(node, ast.FunctionDef) and node is not fn:
            bound.add(node.name)
        elif isinstance(node, ast.arg):  # a nested function's or lambda's
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return list(dict.fromkeys(n for n in loads if n not in bound))


def _annotation_nodes(node: ast.AST):
    if isinstance(node, ast.arg) and node.annotation is not None:
        yield from ast.walk(node.annotation)
    elif isinstance(node, ast.FunctionDef) and node.returns is not None:
        yield from ast.walk(node.returns)
    elif isinstance(node, ast.AnnAssign):
        yield from ast.walk(node.annotation)


def _self_attributes_read(fn: ast.FunctionDef) -> list[str]:
    """Attributes the method reads from its first argument (`self.x`), once each."""
    args = fn.args.posonlyargs + fn.args.args
    if not args:
        return []
    me = args[0].arg
    return list(dict.fromkeys(n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                              and isinstance(n.value, ast.Name) and n.value.id == me))
