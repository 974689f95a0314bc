# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Grid World environment server components."""

from .grid_world_environment import GridWorldEnvironment

__all__ = ["GridWorldEnvironment"]
