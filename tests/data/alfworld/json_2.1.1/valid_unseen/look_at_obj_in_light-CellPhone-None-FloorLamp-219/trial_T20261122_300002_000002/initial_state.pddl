(define (problem plan_trial_T20261122_300002_000002)
    (:domain alfred)
    (:objects
        agent1 - agent
        CellPhoneType - otype
        FloorLampType - otype
        SofaType - rtype
        SideTableType - rtype
        DrawerType - rtype
        CellPhone_bar__minus_02_dot_43_bar__plus_00_dot_48_bar__plus_01_dot_32 - object
        FloorLamp_bar__plus_02_dot_51_bar__plus_00_dot_00_bar__plus_02_dot_81 - object
        Sofa_bar__minus_02_dot_49_bar__plus_00_dot_01_bar__plus_01_dot_15 - receptacle
        SideTable_bar__plus_02_dot_40_bar__plus_00_dot_00_bar__plus_02_dot_70 - receptacle
        Drawer_bar__minus_02_dot_44_bar__plus_00_dot_40_bar__minus_00_dot_25 - receptacle
        loc_bar__minus_6_bar_5_bar_3_bar_45 - location
        loc_bar_7_bar_9_bar_1_bar_30 - location
        loc_bar__minus_6_bar__minus_1_bar_3_bar_30 - location
        loc_bar_1_bar_3_bar_0_bar_30 - location
        )
    (:init
        (receptacleType Sofa_bar__minus_02_dot_49_bar__plus_00_dot_01_bar__plus_01_dot_15 SofaType)
        (receptacleType SideTable_bar__plus_02_dot_40_bar__plus_00_dot_00_bar__plus_02_dot_70 SideTableType)
        (receptacleType Drawer_bar__minus_02_dot_44_bar__plus_00_dot_40_bar__minus_00_dot_25 DrawerType)
        (objectType CellPhone_bar__minus_02_dot_43_bar__plus_00_dot_48_bar__plus_01_dot_32 CellPhoneType)
        (objectType FloorLamp_bar__plus_02_dot_51_bar__plus_00_dot_00_bar__plus_02_dot_81 FloorLampType)
        (canContain SofaType CellPhoneType)
        (canContain SideTableType CellPhoneType)
        (canContain DrawerType CellPhoneType)
        (openable Drawer_bar__minus_02_dot_44_bar__plus_00_dot_40_bar__minus_00_dot_25)
        (pickupable CellPhone_bar__minus_02_dot_43_bar__plus_00_dot_48_bar__plus_01_dot_32)
        (toggleable FloorLamp_bar__plus_02_dot_51_bar__plus_00_dot_00_bar__plus_02_dot_81)
        (atLocation agent1 loc_bar_1_bar_3_bar_0_bar_30)
        (receptacleAtLocation Sofa_bar__minus_02_dot_49_bar__plus_00_dot_01_bar__plus_01_dot_15 loc_bar__minus_6_bar_5_bar_3_bar_45)
        (receptacleAtLocation SideTable_bar__plus_02_dot_40_bar__plus_00_dot_00_bar__plus_02_dot_70 loc_bar_7_bar_9_bar_1_bar_30)
        (receptacleAtLocation Drawer_bar__minus_02_dot_44_bar__plus_00_dot_40_bar__minus_00_dot_25 loc_bar__minus_6_bar__minus_1_bar_3_bar_30)
        (inReceptacle CellPhone_bar__minus_02_dot_43_bar__plus_00_dot_48_bar__plus_01_dot_32 Sofa_bar__minus_02_dot_49_bar__plus_00_dot_01_bar__plus_01_dot_15)
        (inReceptacle FloorLamp_bar__plus_02_dot_51_bar__plus_00_dot_00_bar__plus_02_dot_81 SideTable_bar__plus_02_dot_40_bar__plus_00_dot_00_bar__plus_02_dot_70)
        (objectAtLocation CellPhone_bar__minus_02_dot_43_bar__plus_00_dot_48_bar__plus_01_dot_32 loc_bar__minus_6_bar_5_bar_3_bar_45)
        (objectAtLocation FloorLamp_bar__plus_02_dot_51_bar__plus_00_dot_00_bar__plus_02_dot_81 loc_bar_7_bar_9_bar_1_bar_30)
        )
    (:goal
        (and
            (exists (?ot - object ?r - receptacle ?a - agent ?l - location)
                (and
                    (objectType ?ot FloorLampType)
                    (toggleable ?ot)
                    (isToggled ?ot)
                    (receptacleAtLocation ?r ?l)
                    (atLocation ?a ?l)
                    (inReceptacle ?ot ?r)
                )
            )
            (exists (?o - object ?a - agent)
                (and
                    (objectType ?o CellPhoneType)
                    (holds ?a ?o)
                )
            )
        )
    )
)
