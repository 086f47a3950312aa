"""Packaging entry point; all metadata lives in setup.cfg."""

from setuptools import setup

setup()
