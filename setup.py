"""Builds graphify's one optional C helper (`graphify/reads/_dictwatch.c`: dict watchers for the
per-call check of what a graph reads). Everything else is in pyproject.toml. Without a C
compiler the install still succeeds, and graphify checks those dicts from Python instead
(exact, slower per call)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("graphify.reads._dictwatch", ["graphify/reads/_dictwatch.c"], optional=True)])
