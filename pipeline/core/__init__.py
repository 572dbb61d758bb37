"""The ground floor: errors, text helpers, config validation, caches, extras, progress, provenance, reaper."""
