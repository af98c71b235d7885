"""Engines that run a target model: the project's own tiny one for tests and demos."""
