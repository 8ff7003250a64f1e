"""capsteer.capture"""
