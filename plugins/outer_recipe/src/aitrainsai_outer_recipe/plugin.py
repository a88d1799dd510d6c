"""Registers the recipe outer trainer."""

from aitrainsai import hookimpl


@hookimpl
def register_outer_trainers(register):
    from aitrainsai_outer_recipe.policy import RecipePolicy

    register(RecipePolicy)
