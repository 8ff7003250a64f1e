"""capsteer.config"""
