"""The transformers release a model is loaded with: inside the tested range, and not one known to fail for it.

tiermoe drives transformers' own modules (attention, routers, linear-attention layers and their cache calls), so a
release can break an architecture without any import failing: transformers 5.20-5.23 call Qwen3-Next's
linear-attention cache by another name and read its states another way, and every request then ended in an error.
The range in pyproject.toml is what CI tests (scripts/test.sh: the whole suite on the newest release below the cap,
the exactness tests on the floor); it is read here from the installed package's metadata (or, run from a checkout
that was never installed, from its pyproject.toml), so it is written once.

At load, a known failure is one line that says which release to install; a release outside the tested range (a
`pip install --no-deps`, a newer release) is one warning line, and the load goes on.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tiermoe.errors import TiermoeError

log = logging.getLogger(__name__)

# model_type -> (the first release it runs on, why the older ones fail); measured with the exactness tests
# (`pytest -m exactness`) on transformers 5.20.0 and 5.23.0, where the other architectures pass.
NEEDS_AT_LEAST = {
    "qwen3_next": ("5.24.0", ("its linear-attention layers take the cache as `cache_params` and read conv states "
                              "through the cache's own layers")),
}


def declared_range() -> SpecifierSet | None:
    """The transformers range tiermoe declares (pyproject.toml), or None where neither its metadata nor its
    pyproject.toml can be read."""
    try:
        requirements = metadata.requires("tiermoe") or []
    except metadata.PackageNotFoundError:
        requirements = _checkout_requirements()
    for line in requirements:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is None:
            return req.specifier
    return None


def range_ends(tested: SpecifierSet) -> tuple[Version, Version]:
    """(floor, cap) of a range written `>=floor,<cap`: the lowest release tested and the first one not tested."""
    bounds = {spec.operator: Version(spec.version) for spec in tested}
    if set(bounds) != {">=", "<"}:
        raise TiermoeError(f"the transformers range {tested} is not written as >=FLOOR,<CAP")
    return bounds[">="], bounds["<"]


def _checkout_requirements() -> list[str]:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        return []
    if not pyproject.is_file():
        return []
    return tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", [])


def installed_release() -> str:
    import transformers

    return transformers.__version__


def check_transformers_for(model_type: str, installed: str | None = None,
                           tested: SpecifierSet | None = None) -> None:
    """Raise TiermoeError (one line) if `installed` (default: the imported transformers) is known to fail for
    `model_type`; log one warning if it is outside the `tested` range (default: declared_range())."""
    installed = installed or installed_release()
    version = Version(installed)
    tested = tested if tested is not None else declared_range()
    needed = NEEDS_AT_LEAST.get(model_type)
    if needed is not None and version < Version(needed[0]):
        install = _written(tested) if tested is not None else ">=" + needed[0]
        raise TiermoeError(f"{model_type} needs transformers >= {needed[0]} ({needed[1]}); transformers {installed} "
                           f"is installed: pip install 'transformers{install}'")
    if tested is not None and not tested.contains(version, prereleases=True):
        log.warning("transformers %s is outside the range tiermoe is tested on (%s); if a model misbehaves, "
                    "pip install 'transformers%s'", installed, _written(tested), _written(tested))


def _written(tested: SpecifierSet) -> str:
    """`>=5.24,<5.26` rather than SpecifierSet's sorted `<5.26,>=5.24`."""
    return ",".join(sorted(map(str, tested), reverse=True))
