"""The drafter protocol, the kind's half: what a kind of drafter declares besides decoding
(`Kind`, on top of the runtime half `decoding.drafter.Drafter`). Every member has a default
or a one-line refusal here, so the registry, the formats, the tools and the commands ask a
kind directly and never probe it for a capability.

A new kind subclasses `Kind` (or `decoding.drafter.FromLastHidden` and `Kind` together),
declares `kind`, `batch_axis`, `context`, `formats`, `matches` and `axes`, implements
`begin` / `advance` / `propose` (or `start`), and overrides what it can do of the rest;
tests/drafters/test_conformance.py runs it through the doors.
"""

from __future__ import annotations

from medusa_jax.decoding.drafter import Drafter, refuse_head_fn
from medusa_jax.drafters.io import HeadsFormatError

Params = object  # a parameter pytree


class Formats:
    """A kind's file formats (`Kind.formats`): what `drafters.formats` and
    `drafters.artifact` ask of a kind, never probing it. A kind's formats subclass this,
    declare `kind`, `what` and `layouts` and implement `save`, `load` and `sizes`;
    `wrong_layout` and `native_cfg` have defaults."""

    kind: str
    what: str  # how messages name the kind's drafters: "Medusa heads"
    layouts: tuple = ()  # `drafters.io.Layout`s: detect a folder or a file, read, write

    @classmethod
    def save(cls, heads: Params, cfg, file) -> tuple[dict, dict]:
        """(tensors, metadata fields) of our artifact (`drafters.formats.save_heads`)."""
        raise HeadsFormatError(f"{cls.what} have no part in our artifact ({file})")

    @classmethod
    def load(cls, tensors: dict, meta: dict, cfg, file) -> Params:
        """The checked parameters from our artifact's tensors and metadata (`cfg`: the
        backbone's config; None: not checked against one), bound when the kind needs it."""
        raise HeadsFormatError(f"{file}: {cls.what} are not read from our artifact")

    @classmethod
    def sizes(cls, heads: Params) -> tuple[int, int]:
        """(hidden size, vocabulary size) of the backbone `heads` imply."""
        raise HeadsFormatError(f"{cls.what} declare no backbone sizes")

    @staticmethod
    def wrong_layout(layout: str) -> str | None:
        """Why heads of this kind cannot be written in `layout`, a layout of another kind
        (None: the generic message, naming the layouts they can be written in)."""
        return None

    @staticmethod
    def native_cfg(meta: dict, file, cfg):
        """The backbone config our artifact of this kind is read with when no model is
        given: `cfg` (the hidden and vocabulary sizes it records) unless the kind needs
        more (the layers it reads, the backbone's own config)."""
        return cfg


class Kind(Drafter):
    """A kind of drafter: the runtime half (`Drafter`) and the kind's declaration."""

    # the kind's file formats: a `Formats` subclass, or "module:class" naming one (imported
    # on first use); `drafters.formats` loops over every kind's (None: no files)
    formats: object = None
    # the tree this kind decodes with unless told (None: the model's); a kind whose best tree
    # differs from a head-shaped one (the n-gram drafter's chain) says so here
    default_tree = None

    @classmethod
    def matches(cls, heads: Params) -> bool:
        """Whether `heads` (arrays, numpy or shapes) are this kind's parameters."""
        return False

    @classmethod
    def axes(cls, heads: Params) -> dict:
        """{name: logical axes} of the parameters `heads` has (`runtime.sharding`)."""
        return {}

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        """(head count, blocks per head) of `heads`: what our artifact's metadata and the
        training report record."""
        raise ValueError(f"drafter kind {cls.kind!r} records no (heads, blocks) shape")

    @classmethod
    def from_head_fn(cls, head_fn) -> "Kind":
        """The drafter of plain parameters of this kind (`head_fn`: a head function, for
        the kinds that take one; others refuse it in one line)."""
        refuse_head_fn(head_fn, f"these are {cls.kind} drafter parameters")
        return cls()

    @classmethod
    def init(cls, cfg, backbone: Params, key, depth: int) -> Params:
        """Fresh parameters of `depth` levels for a backbone of config `cfg`
        (`tools.sizing`)."""
        raise ValueError(f"drafter kind {cls.kind!r} has no fresh initialisation here; "
                         f"train one with its recipe")

    @staticmethod
    def cost(hidden: int, vocab: int, **kw) -> dict:
        """Seconds of one drafting call on one token, per variant (`tools.bench`)."""
        raise ValueError("this drafter kind has no cost model (--heads-cost)")

    @staticmethod
    def enlarge(heads: Params, src, dst, grow) -> Params:
        """The same drafter for a backbone grown from config `src` to `dst` by
        `tools.enlarge` (`grow`: that module, whose `plan` and `place` grow a layer)."""
        raise ValueError("this drafter kind cannot be enlarged with its backbone")

    @classmethod
    def without_files(cls, **options) -> Params:
        """The heads of a kind that needs no files (`--heads ngram`), bound to their drafter;
        a kind read from files refuses."""
        raise ValueError(f"drafter kind {cls.kind!r} is read from files: give its folder")


def refuse_unbound(head_fn, what: str, why: str, bind: str):
    """`Kind.from_head_fn` of a kind whose configuration its tensors do not hold (`why`): a
    head function, then the bare parameters, refused in one line (`bind`: how to bind them)."""
    refuse_head_fn(head_fn, f"these are {what}")
    raise ValueError(f"these {what} carry no configuration ({why}): load them with "
                     f"load_heads, or bind them with {bind}")
