#!/usr/bin/env python3
"""kvhost's sglang host pools against the installed sglang's contract.

Reads the source of the sglang in the engine venv (tests/engine_env.py,
python/requirements-engines.txt) with `ast`, and checks that each of
kvhost.sglang's MHATokenToKVPoolHost and MLATokenToKVPoolHost, and the
plugin's MHATokenToKVPoolHost, AsymmetricMHATokenToKVPoolHost,
MLATokenToKVPoolHost, MHATokenToKOnlyPoolHost, MambaPoolHost and
DSAIndexerPoolHost (the pools sglang's builders construct) provides:
  - every abstract method of sglang's HostKVCache, with a signature that
    binds every call the abstract signature allows (positional and keyword
    parameters, and the calls that leave the defaults out);
  - the plugin's: the constructor of sglang's class of the same name (the
    same binds);
  - every member that sglang's HostPoolGroup (pool_host/group.py),
    L2TransferEngine (l2_transfer.py), HybridCacheController
    (hybrid_cache/hybrid_cache_controller.py) and the storage backend
    factory (storage/backend_factory.py) read on a host pool, and for each
    call among them, the keyword arguments sglang passes.
A member counts as provided when the class (with its bases, sglang's
HostKVCache among them) has it, or when kvhost's own classes assign it to
`self`; getattr(pool, name, default) reads are optional and not required,
and neither is, of a plugin class, a member sglang's class of that name
neither has nor assigns.
Prints what it checked and names every missing or incompatible member.
  usage: python_sglang_contract_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
"""
import ast
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_env  # noqa: E402

#: Members sglang reads only for features kvhost does not support yet
#: (docs/SGLANG.md lists them): not required, printed with the reason.
NOT_PROVIDED = {
    "host_kv_data_refs": "host receive (PD disaggregation into the host pool)",
    "placement": "page-interleaved device pools (PageInterleaveHostPool)",
    "owned_rows": "page-interleaved device pools (PageInterleaveHostPool)",
    "shard_rank": "KV-sharded host pools (start_owner)",
}

#: (module, class or None for the whole module, names bound to a host pool
#: itself rather than reached through `.host_pool`).
READERS = (
    ("sglang.srt.mem_cache.pool_host.group", "HostPoolGroup", ()),
    ("sglang.srt.mem_cache.l2_transfer", "L2TransferEngine", ()),
    ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController", ()),
    ("sglang.srt.mem_cache.storage.backend_factory", None, ("mem_pool_host",)),
)


def _is_pool_expr(node, aliases, direct):
    """Whether `node` evaluates to a host pool: x.host_pool, or a name bound
    to one in this function."""
    if isinstance(node, ast.Attribute) and node.attr == "host_pool":
        return True
    return isinstance(node, ast.Name) and (node.id in aliases or node.id in direct)


def pool_reads(tree, direct):
    """{member: [(line, keywords or None, optional)]} read on a host pool."""
    reads = {}

    def add(name, line, keywords=None, optional=False):
        reads.setdefault(name, []).append((line, keywords, optional))

    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases = set()
        for node in ast.walk(fn):  # names bound to `<...>.host_pool`
            if isinstance(node, ast.Assign) and _is_pool_expr(node.value, (), ()):
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if isinstance(node, (ast.For, ast.comprehension)) and isinstance(
                    node.target, ast.Name) and isinstance(node.iter, ast.Call) and \
                    any(isinstance(a, ast.Attribute) and a.attr == "host_pool"
                        for a in ast.walk(node.iter)):
                aliases.add(node.target.id)
        calls = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                calls[id(node.func)] = node
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and _is_pool_expr(node.args[0], aliases, direct)
                    and isinstance(node.args[1], ast.Constant)):
                optional = node.func.id == "hasattr" or len(node.args) == 3
                add(node.args[1].value, node.lineno, optional=optional)
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and _is_pool_expr(node.value, aliases, direct):
                call = calls.get(id(node))
                kws = None
                if call is not None:
                    kws = [k.arg for k in call.keywords if k.arg is not None]
                add(node.attr, node.lineno, kws)
    return reads


def abstract_methods(tree):
    """HostKVCache's abstract method names (pool_host/base.py)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "HostKVCache":
            return [f.name for f in node.body if isinstance(f, ast.FunctionDef) and any(
                (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
                or (isinstance(d, ast.Name) and d.id == "abstractmethod")
                for d in f.decorator_list)]
    raise AssertionError("sglang's pool_host/base.py has no class HostKVCache")


def self_assigned(cls, package="kvhost"):
    """Attributes `package`'s own classes in cls's MRO assign to self."""
    names = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(package):
            continue
        tree = ast.parse(inspect.getsource(klass))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) \
                            and el.value.id == "self":
                        names.add(el.attr)
    return names


def binds(theirs, ours):
    """Problems binding every call `theirs` allows to `ours` (signatures)."""
    params = [p for p in theirs.parameters.values() if p.name != "self"]
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwo = [p for p in params if p.kind == p.KEYWORD_ONLY]
    calls = {
        "every argument": ([None] * len(pos), {p.name: None for p in kwo}),
        "the required ones": ([None] * sum(p.default is p.empty for p in pos),
                              {p.name: None for p in kwo if p.default is p.empty}),
        "by keyword": ([], {p.name: None for p in pos + kwo}),
    }
    problems = []
    for what, (args, kwargs) in calls.items():
        try:
            ours.bind(None, *args, **kwargs)
        except TypeError as e:
            problems.append(f"a call with {what} ({e})")
    return problems


def source_tree(module):
    __import__(module)
    path = inspect.getsourcefile(sys.modules[module])
    with open(path) as f:
        return ast.parse(f.read(), path), path


def check_class(ours, theirs_cls, base_cls, abstract, reads):
    """Every problem of kvhost class `ours`, each a line naming the member
    (theirs_cls None: the constructor is not checked)."""
    problems = []
    assigned = self_assigned(ours)
    # A member sglang's own class of that name lacks is not asked of ours.
    theirs = self_assigned(theirs_cls, "sglang") if theirs_cls else None

    def has(name):
        return hasattr(ours, name) or name in assigned

    def sglang_lacks(name):
        return theirs is not None and not hasattr(theirs_cls, name) and name not in theirs

    for name in abstract:
        if getattr(ours, name, None) in (None, getattr(base_cls, name, None)):
            problems.append(f"abstract method {name}() not implemented")
            continue
        for p in binds(inspect.signature(getattr(base_cls, name)),
                       inspect.signature(getattr(ours, name))):
            problems.append(f"{name}(): HostKVCache's signature allows {p}")
    for p in binds(inspect.signature(theirs_cls.__init__),
                   inspect.signature(ours.__init__)) if theirs_cls else ():
        problems.append(f"__init__: sglang's {theirs_cls.__name__} constructor allows {p}")
    for (where, name), uses in sorted(reads.items()):
        if all(opt for _, _, opt in uses) or name in NOT_PROVIDED or sglang_lacks(name):
            continue
        lines = ",".join(str(line) for line, _, _ in uses)
        if not has(name):
            problems.append(f"{name}: read at {where}:{lines}, missing")
            continue
        fn = getattr(ours, name, None)
        for line, kws, _ in uses:
            if kws and callable(fn):
                sig = inspect.signature(fn)
                try:
                    sig.bind_partial(*([None] * 0), **{k: None for k in kws})
                except TypeError as e:
                    problems.append(f"{name}(): called at {where}:{line} with "
                                    f"{', '.join(k + '=' for k in kws)}: {e}")
    return problems


def main():
    source_dir = sys.argv[3]
    engine_env.enter(source_dir)
    sys.path.insert(0, os.path.join(source_dir, "python"))
    os.environ.setdefault("KVHOST_LIBRARY", sys.argv[2])
    import sglang  # noqa: PLC0415 (the engine venv's)
    from sglang.srt.mem_cache.pool_host import base as sg_base  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host import mha as sg_mha  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host import dsa as sg_dsa  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host import mamba as sg_mamba  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host import mla as sg_mla  # noqa: PLC0415
    from kvhost import sglang as kv  # noqa: PLC0415

    print(f"sglang {sglang.__version__} at {os.path.dirname(sglang.__file__)}")
    base_tree, _ = source_tree("sglang.srt.mem_cache.pool_host.base")
    abstract = abstract_methods(base_tree)
    print(f"HostKVCache abstract methods: {', '.join(abstract)}")
    reads = {}
    for module, cls_name, direct in READERS:
        tree, path = source_tree(module)
        if cls_name is not None:
            tree = next(n for n in ast.walk(tree)
                        if isinstance(n, ast.ClassDef) and n.name == cls_name)
        where = os.path.relpath(path, os.path.dirname(sglang.__file__))
        found = pool_reads(tree, direct)
        print(f"{cls_name or module}: reads {', '.join(sorted(found))} on a host pool")
        for name, uses in found.items():
            reads.setdefault((where, name), []).extend(uses)
    print(f"not provided (unsupported features): "
          f"{'; '.join(f'{k} ({v})' for k, v in NOT_PROVIDED.items())}")
    # The plugin's pools take sglang's constructors; kvhost.sglang's take a
    # name and a shape (no constructor check).
    checked = [(kv.MHATokenToKVPoolHost, None), (kv.MLATokenToKVPoolHost, None)]
    failures = 0
    try:
        from kvhost.sglang import plugin as sglang_plugin  # noqa: PLC0415
        checked[:0] = [
            (sglang_plugin.MHATokenToKVPoolHost, sg_mha.MHATokenToKVPoolHost),
            (sglang_plugin.AsymmetricMHATokenToKVPoolHost, sg_mha.AsymmetricMHATokenToKVPoolHost),
            (sglang_plugin.MLATokenToKVPoolHost, sg_mla.MLATokenToKVPoolHost),
            (sglang_plugin.MHATokenToKOnlyPoolHost, sg_mha.MHATokenToKOnlyPoolHost),
            (sglang_plugin.MambaPoolHost, sg_mamba.MambaPoolHost),
            (sglang_plugin.DSAIndexerPoolHost, sg_dsa.DSAIndexerPoolHost)]
    except ImportError as e:
        print(f"FAIL kvhost.sglang.plugin: {e}")
        failures += 1
    for ours, theirs in checked:
        problems = check_class(ours, theirs, sg_base.HostKVCache, abstract, reads)
        if not issubclass(ours, sg_base.HostKVCache):
            problems.insert(0, "does not subclass sglang's HostKVCache")
        for p in problems:
            print(f"FAIL {ours.__module__}.{ours.__name__}: {p}")
        if not problems:
            print(f"ok   {ours.__module__}.{ours.__name__}: the contract holds")
        failures += len(problems)
    if failures:
        print(f"{failures} contract problems")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
