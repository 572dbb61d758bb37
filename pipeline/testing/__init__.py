"""Test helpers that build real (tiny, random-weight) components offline, so tests never mock an engine."""
