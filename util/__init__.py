"""Small helpers that are not part of the method: atomic files, precision, memory estimate, run log."""
