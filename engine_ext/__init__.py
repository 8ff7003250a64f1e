"""capsteer.engine_ext"""
