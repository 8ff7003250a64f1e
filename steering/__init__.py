"""capsteer.steering"""
