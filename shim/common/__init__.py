"""Tree-agnostic shim pieces: tree bootstrap + guard, symmetric heap, cute argument building."""
